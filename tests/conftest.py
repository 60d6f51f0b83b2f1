"""Shared fixtures: repo paths, a tiny model built once per session, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "data"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny LLaMA + locally trained tokenizer, the same builder `make demo` uses."""
    from shardtune.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("SHARDTUNE_DEBUG", None)
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run the real `shardtune` entry point in a subprocess."""
    return subprocess.run([sys.executable, "-m", "shardtune", *args], cwd=cwd, env=cli_env(**env),
                          capture_output=True, text=True, timeout=timeout)
