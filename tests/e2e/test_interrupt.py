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

from shardtune.engines.checkpoint_writer import PAUSE_AT_VARIABLE
from shardtune.launch.preemption import INTERRUPTED_EXIT_CODE, REQUEUE_EXIT_CODE
from tests.conftest import REPO, cli_env, overrides_merged, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# max_steps far beyond what runs before the signal: the tiny model takes 100+ steps a second, and a run that ends
# before SIGTERM arrives tests nothing.
ARGS = ("examples/tiny/sft_full.yaml", "max_steps=100000", "save_steps=5", "logging_steps=5", "do_eval=false",
        "eval_strategy=no", "val_size=0", "plot_loss=false", "per_device_train_batch_size=2",
        "gradient_accumulation_steps=1")


class Job:
    """``shardtune train`` in its own session, its output in files: a pipe nobody reads until the end would stall
    a run that writes more than the pipe holds (a CI run once waited 300 s for a checkpoint that never came)."""

    def __init__(self, model: Path, out: Path, logs: Path, *extra: str, **env: str) -> None:
        argv = [sys.executable, "-m", "shardtune", "train", *overrides_merged([*ARGS, f"model_name_or_path={model}",
                                                                            f"output_dir={out}", *extra])]
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = logs / "stdout.txt", logs / "stderr.txt"
        with self.stdout_path.open("w") as stdout, self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(argv, cwd=REPO, env=cli_env(**env), stdout=stdout, stderr=stderr,
                                            start_new_session=True)

    def output(self) -> tuple[str, str]:
        return self.stdout_path.read_text(errors="replace"), self.stderr_path.read_text(errors="replace")

    def wait_for(self, folder: Path, pattern: str, timeout: float = 300) -> None:
        """Until a path matching ``pattern`` exists in ``folder``; fails at once, with the run's output, if the run
        ends first or time runs out. A pattern, not one checkpoint: the run saves every 5 steps, so checkpoint-5
        can be rotated away between two looks."""
        deadline = time.monotonic() + timeout
        while not any(folder.glob(pattern)):
            code = self.process.poll()
            assert code is None, f"the run ended (exit code {code}) before {pattern}: {self.output()[1][-3000:]}"
            assert time.monotonic() < deadline, f"{pattern} never appeared: {self.output()[1][-3000:]}"
            time.sleep(0.1)

    def finish(self, timeout: float) -> tuple[str, str]:
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.output()


def run_to_the_end(model: Path, out: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    """A run no signal reaches (a reference, a resume): through run_cli, served by the session's rank server where
    it can be; only the interrupted run needs a launcher of its own to signal."""
    return run_cli("train", *ARGS, f"model_name_or_path={model}", f"output_dir={out}", *extra, timeout=300, **env)


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "torchrun-2"])
def test_sigterm_saves_and_the_same_command_resumes(nproc, tiny_model_dir, tmp_path):
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"} if nproc == 2 else {}
    job = Job(tiny_model_dir, tmp_path, tmp_path.parent / f"{tmp_path.name}-logs" / "first", **env)
    try:
        job.wait_for(tmp_path, "checkpoint-*/COMPLETE")
        os.kill(job.process.pid, signal.SIGTERM)
    finally:
        _, stderr = job.finish(timeout=120)
    assert job.process.returncode == REQUEUE_EXIT_CODE and "Traceback" not in stderr, stderr[-3000:]
    assert not (tmp_path / "train_results.json").exists()
    steps = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*") if (p / "COMPLETE").is_file())
    assert steps and steps[-1] >= 5
    resumed = run_to_the_end(tiny_model_dir, tmp_path, "overwrite_output_dir=false", f"max_steps={steps[-1] + 4}",
                             **env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp_path / f'checkpoint-{steps[-1]}'}" in resumed.stdout
    assert json.loads((tmp_path / "train_results.json").read_text())["global_step"] == steps[-1] + 4


def test_ctrl_c_exits_130_and_saves(tiny_model_dir, tmp_path):
    job = Job(tiny_model_dir, tmp_path, tmp_path.parent / f"{tmp_path.name}-logs")
    try:
        job.wait_for(tmp_path, "checkpoint-*/COMPLETE")
        os.kill(job.process.pid, signal.SIGINT)
    finally:
        _, stderr = job.finish(timeout=120)
    assert job.process.returncode == INTERRUPTED_EXIT_CODE, stderr[-3000:]  # a person, not a scheduler: no requeue


# Constant learning rate, no warm-up: the curve does not depend on max_steps, so a run preempted at any step and
# resumed with max_steps=12 must log the reference run's losses.
CURVE = ("lr_scheduler_type=constant", "warmup_ratio=0", "warmup_steps=0", "logging_steps=1")


def losses_by_step(out: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return {r["current_steps"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.distributed
@pytest.mark.parametrize("stop_signal", [pytest.param(signal.SIGTERM, marks=pytest.mark.matrix), signal.SIGUSR1],
                         ids=["sigterm", "sigusr1"])
def test_a_preemption_signal_during_an_async_save_finishes_it_and_the_requeued_run_continues_the_curve(
        stop_signal, tiny_model_dir, tmp_path):
    """Under torchrun with 2 processes: the signal arrives while rank 0 is held inside the save of checkpoint-5.
    That save completes, the next step stops, its checkpoint is written, the job exits 143 (requeue), and the
    same command continues the uninterrupted curve."""
    two = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}
    reference = tmp_path / "reference"
    done = run_to_the_end(tiny_model_dir, reference, *CURVE, "max_steps=12", **two)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "run"
    job = Job(tiny_model_dir, out, tmp_path / "logs-first", *CURVE, "async_save=true",
              **two, **{PAUSE_AT_VARIABLE: "staged#1@0"})
    try:
        job.wait_for(out, "checkpoint-5")  # the save has begun; rank 0 is held in it for seconds
        assert not (out / "checkpoint-5" / "COMPLETE").exists()
        os.kill(job.process.pid, stop_signal)
    finally:
        _, stderr = job.finish(timeout=120)
    assert job.process.returncode == REQUEUE_EXIT_CODE and "Traceback" not in stderr, stderr[-3000:]
    complete = sorted(int(p.parent.name.split("-")[1]) for p in out.glob("checkpoint-*/COMPLETE"))
    assert complete[0] == 5 and len(complete) >= 2, complete  # the save in flight, then the stop's own
    resumed = run_to_the_end(tiny_model_dir, out, *CURVE, "async_save=true", "overwrite_output_dir=false",
                             "max_steps=12", **two)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / f'checkpoint-{complete[-1]}'}" in resumed.stdout
    expected, losses = losses_by_step(reference), losses_by_step(out)
    for step in range(complete[-1] + 1, 13):
        assert losses[step] == pytest.approx(expected[step], rel=2e-3), (step, losses, expected)
