"""A second `shardtune train` into a live run's output_dir is refused, whatever overwrite_output_dir says, and the
live run's checkpoints stay as they were; runs that start together into one folder: one trains, the others are
refused; under the user's own torchrun, global rank 0 holds the lock for every rank of its job."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.launch.run_lock import read_holder
from shardtune.launch.torchrun import find_free_port
from tests.conftest import REPO, cli_env, descendant_pids, run_cli
from tests.e2e.test_interrupt import Job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of every checkpoint folder, by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.glob("checkpoint-*/**/*"))
            if p.is_file()}


def test_a_second_train_into_a_live_run_is_refused_and_its_checkpoints_stay(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    job = Job(tiny_model_dir, out, tmp_path / "logs", "save_total_limit=1000")
    try:
        job.wait_for(out, "checkpoint-10/COMPLETE")
        job.process.send_signal(signal.SIGSTOP)  # hold the run still: its files must not move
        before = snapshot(out)
        second = run_cli("train", "examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}",
                         f"output_dir={out}", "overwrite_output_dir=true", "max_steps=2", timeout=120)
        check = run_cli("check", "examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}",
                        f"output_dir={out}", timeout=120)
        after = snapshot(out)
        job.process.send_signal(signal.SIGCONT)
    finally:
        job.process.terminate()
        job.finish(timeout=120)
    assert second.returncode == 2, second.stderr
    assert "Traceback" not in second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert len(errors) == 1 and f"pid {job.process.pid} on" in errors[0] and "shardtune status" in errors[0]
    assert check.returncode == 2 and errors[0] in check.stderr  # check says what train says
    assert before and after == before


def test_runs_started_together_into_one_folder_train_once(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "shardtune", "train", "examples/tiny/sft_full.yaml",
            f"model_name_or_path={tiny_model_dir}", f"output_dir={out}", "max_steps=30", "save_steps=10",
            "plot_loss=false"]
    runs = [subprocess.Popen(argv, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    results = [(run.wait(timeout=300), run.communicate()[1]) for run in runs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "belongs to a live run" in refused and "Traceback" not in refused
    assert (out / "train_results.json").is_file() and not (out / ".shardtune" / "run.lock").exists()


@pytest.mark.distributed
def test_rank_0_holds_the_lock_under_the_users_torchrun(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(find_free_port()), "-m", "shardtune.train", "examples/tiny/sft_lora.yaml",
            f"model_name_or_path={tiny_model_dir}", f"output_dir={out}", "max_steps=100000", "save_steps=5",
            "plot_loss=false"]
    run = subprocess.Popen(argv, cwd=REPO, env=cli_env(GLOO_SOCKET_IFNAME="lo"), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob("checkpoint-*/COMPLETE")):
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        holder = read_holder(out)
        assert holder is not None and holder.job is not None and holder.job.startswith("ranks@")
        second = run_cli("train", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}",
                         f"output_dir={out}", "max_steps=2", timeout=120)
        assert second.returncode == 2 and f"pid {holder.pid} on" in second.stderr, second.stderr
    finally:
        # SIGTERM to the ranks, as Ctrl-C in a terminal gives it: they finish the step, save and exit 0 (torchrun
        # itself takes a signal as a failure).
        for pid in descendant_pids(run.pid, lambda cmdline: "shardtune.train" in cmdline):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        stderr = run.communicate(timeout=120)[1]
    assert run.returncode == 0, stderr[-3000:]
    assert not (out / ".shardtune" / "run.lock").exists()
