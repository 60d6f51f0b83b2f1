"""Ctrl-C / SIGTERM during training: a checkpoint is saved, the exit is clean, the same command resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, overrides_merged

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ARGS = ("examples/tiny/sft_full.yaml", "max_steps=400", "save_steps=5", "logging_steps=5", "do_eval=false",
        "eval_strategy=no", "val_size=0", "plot_loss=false", "per_device_train_batch_size=2",
        "gradient_accumulation_steps=1")


def start(model: Path, out: Path, *extra: str, **env: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shardtune", "train", *overrides_merged([*ARGS, f"model_name_or_path={model}",
                                                                        f"output_dir={out}", *extra])]
    return subprocess.Popen(argv, cwd=REPO, env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for(path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "torchrun-2"])
def test_sigterm_saves_and_the_same_command_resumes(nproc, tiny_model_dir, tmp_path):
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"} if nproc == 2 else {}
    job = start(tiny_model_dir, tmp_path, **env)
    try:
        wait_for(tmp_path / "checkpoint-5" / "COMPLETE")
        os.kill(job.pid, signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0 and "Traceback" not in stderr, stderr[-3000:]
    assert not (tmp_path / "train_results.json").exists()
    steps = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*") if (p / "COMPLETE").is_file())
    assert steps and steps[-1] >= 5
    resumed = start(tiny_model_dir, tmp_path, "overwrite_output_dir=false", "max_steps=" + str(steps[-1] + 4),
                    **env)
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr[-3000:]
    assert f"resuming from {tmp_path / f'checkpoint-{steps[-1]}'}" in stdout
    assert json.loads((tmp_path / "train_results.json").read_text())["global_step"] == steps[-1] + 4
