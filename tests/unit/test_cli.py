"""The CLI surface: help lists every key quickly, errors are one line with exit code 2, docs stay generated."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.config.reference import markdown_reference
from shardtune.config.schema import key_names
from tests.conftest import REPO, run_cli

EXAMPLES = sorted(p.relative_to(REPO) for p in (REPO / "examples").rglob("*.yaml")
                  if "accelerate" not in p.parts)


def test_help_lists_every_key_fast():
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "shardtune", "train", "--help"], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0
    for key in key_names():
        assert key in result.stdout
    assert elapsed < 3.0  # generous for a loaded CI box; benchmarks/ measures the real figure


def test_cli_start_imports_no_heavy_library():
    code = "import sys, shardtune.cli, shardtune.config.reference; " \
           "print(sorted(m for m in ('torch','transformers','datasets','peft') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_config_error_is_one_line_exit_2_no_traceback(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: org/m\ndataset: demo\noutput_dir: o\nlerning_rate: 1.0e-4\nlora_rank: x\n")
    result = run_cli("check", str(cfg))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"shardtune: error: {cfg}:4: unknown key 'lerning_rate' (did you mean 'learning_rate'?)",
        f"shardtune: error: {cfg}:5: lora_rank: expected an integer, got 'x'",
    ]


def test_unknown_command_exit_2():
    assert run_cli("trian").returncode == 2


def test_docs_config_reference_is_generated():
    assert (REPO / "docs" / "config.md").read_text() == markdown_reference() + "\n", \
        "docs/config.md is stale: run `make docs`"


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_every_shipped_example_config_validates(example: Path):
    import yaml

    result = run_cli("check", str(example), timeout=120)
    needs_cuda = yaml.safe_load((REPO / example).read_text()).get("quantization_bit") is not None
    if needs_cuda and not _has_cuda():
        assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, "only the missing GPU may be wrong"
    else:
        assert result.returncode == 0, result.stderr


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


ACCELERATE_CONFIGS = sorted((REPO / "examples" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_shipped_accelerate_configs_load_in_accelerate(path: Path):
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(path))  # accelerate rejects unknown keys itself
    assert config.num_processes == 2


def test_check_of_the_tiny_example_imports_no_heavy_library(repo):
    """`shardtune check` stays under a second (benchmarks/check_time.py): the checks import what they need, never
    torch or the modelling code (a check that needs them imports them only when its key is set)."""
    code = ("import sys\nfrom shardtune.cli import main\ntry:\n    main(['check', 'examples/tiny/sft_lora.yaml'])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch','transformers','datasets','peft') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo)
    assert "ok: " in result.stdout, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
