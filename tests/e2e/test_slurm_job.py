"""A real Slurm (munged + slurmctld + slurmd on this host, scripts/slurm_local.sh) runs what `shardtune slurm` writes.

Installs Debian's slurm-wlm and munge when missing (root and apt needed; about a minute); skipped with the reason
when that is impossible.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, cli_env, run_cli

pytestmark = pytest.mark.e2e
SCRIPT = REPO / "scripts" / "slurm_local.sh"
NOT_INSTALLABLE = 3  # slurm_local.sh's exit code when the packages are missing and cannot be installed
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
               "DEADLINE", "PREEMPTED"}


@pytest.fixture(scope="module")
def slurm_conf() -> str:
    """SLURM_CONF of a running one-host cluster with 2 CPUs; daemons this fixture started are stopped after."""
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("Slurm is not installed and apt-get is not available to install it")
    # A cluster someone started with the script (same SHARDTUNE_SLURM_DIR) is used and left running.
    was_running = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, timeout=60).returncode == 0
    started = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=300)
    if started.returncode == NOT_INSTALLABLE:
        pytest.skip(f"no Slurm here: {started.stderr.strip()}")
    assert started.returncode == 0, f"scripts/slurm_local.sh start failed:\n{started.stdout}\n{started.stderr}"
    yield started.stdout.strip().rsplit("SLURM_CONF=", 1)[-1]
    if not was_running:
        subprocess.run(["bash", str(SCRIPT), "stop"], timeout=60)


def wait_for_job(job_id: str, conf: str, timeout: float) -> str:
    """The job's final state, polled from slurmctld (no accounting database on this cluster)."""
    deadline = time.time() + timeout
    state = "UNKNOWN"
    while time.time() < deadline:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                               env=dict(os.environ, SLURM_CONF=conf), timeout=30)
        match = re.search(r"JobState=(\S+)", shown.stdout)
        state = match.group(1) if match else state
        if state in DONE_STATES:
            return state
        time.sleep(2)
    subprocess.run(["scancel", job_id], env=dict(os.environ, SLURM_CONF=conf), timeout=30)
    return f"still {state} after {timeout:.0f} s"


def test_sbatch_script_trains_on_two_gloo_processes(slurm_conf, tiny_model_dir, tmp_path):
    out, script = tmp_path / "out", tmp_path / "job.sbatch"
    submitted = run_cli(
        "slurm", "examples/tiny/sft_full.yaml", "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2",
        "--cpus-per-task", "2", "--memory-per-node", "0", "--time", "00:10:00", "--script", str(script), "--output",
        str(tmp_path / "slurm-%j.out"), "--submit", f"model_name_or_path={tiny_model_dir}", f"output_dir={out}",
        "max_steps=3", "do_eval=false", "save_steps=100", "plot_loss=false", SLURM_CONF=slurm_conf)
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"submitted batch job (\d+)", submitted.stdout).group(1)
    state = wait_for_job(job_id, slurm_conf, timeout=420)
    log = (tmp_path / f"slurm-{job_id}.out").read_text() if (tmp_path / f"slurm-{job_id}.out").exists() else ""
    assert state == "COMPLETED", f"job {job_id}: {state}\n{log[-4000:]}"
    # srun started one shardtune; it read the allocation and started torchrun with c10d on the first host.
    assert re.search(r"--nnodes=1 --rdzv-backend=c10d --rdzv-endpoint=\S+:\d+ --rdzv-id=slurm-" + job_id, log), log
    results = json.loads((out / "train_results.json").read_text())
    assert (results["world_size"], results["global_step"], results["engine"]) == (2, 3, "ddp")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_srun_with_two_tasks_per_node_is_refused_before_anything_starts(slurm_conf, tiny_model_dir):
    done = subprocess.run(
        ["srun", "--nodes=1", "--ntasks-per-node=2", "--time=2", sys.executable, "-m", "shardtune", "check",
         "examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}"],
        cwd=REPO, env=cli_env(SLURM_CONF=slurm_conf), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("srun started 2 shardtune tasks on a node") == 2, done.stderr
    assert "srun --ntasks-per-node=1" in done.stderr


def job_field(job_id: str, conf: str, name: str) -> str:
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                           env=dict(os.environ, SLURM_CONF=conf), timeout=30)
    match = re.search(rf"\b{name}=(\S+)", shown.stdout)
    return match.group(1) if match else ""


def losses_by_step(out) -> dict[int, float]:
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return {r["current_steps"]: r["loss"] for r in records if "loss" in r}


# Constant learning rate, no warm-up: the curve does not depend on max_steps or on where the run was stopped.
CURVE = ("max_steps=12", "save_steps=5", "logging_steps=1", "do_eval=false", "eval_strategy=no", "val_size=0",
         "plot_loss=false", "lr_scheduler_type=constant", "warmup_ratio=0", "async_save=true",
         "per_device_train_batch_size=2", "gradient_accumulation_steps=1")


@pytest.mark.matrix
def test_a_preempted_job_saves_exits_for_a_requeue_and_its_second_attempt_continues_the_curve(
        slurm_conf, tiny_model_dir, tmp_path):
    """SIGTERM to the job's steps (as Slurm's preemption and `scancel --signal` send it) while rank 0 is held inside
    the async save of checkpoint-5: the save completes, the ranks stop with a checkpoint, srun exits 143, the script
    requeues the job, and the second attempt (SLURM_RESTART_COUNT=1) resumes and ends on the uninterrupted curve."""
    from shardtune.engines.checkpoint_writer import PAUSE_AT_VARIABLE

    reference = tmp_path / "reference"
    done = run_cli("train", "examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}",
                   f"output_dir={reference}", *CURVE, FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert done.returncode == 0, done.stderr[-3000:]
    out, script = tmp_path / "out", tmp_path / "job.sbatch"
    submitted = run_cli(
        "slurm", "examples/tiny/sft_full.yaml", "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2",
        "--cpus-per-task", "2", "--memory-per-node", "0", "--time", "00:10:00", "--script", str(script), "--output",
        str(tmp_path / "slurm-%j.out"), "--submit", f"model_name_or_path={tiny_model_dir}", f"output_dir={out}",
        *CURVE, SLURM_CONF=slurm_conf, **{PAUSE_AT_VARIABLE: "staged#1@0"})
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"submitted batch job (\d+)", submitted.stdout).group(1)
    env = dict(os.environ, SLURM_CONF=slurm_conf)
    deadline = time.time() + 300
    while not (out / "checkpoint-5").is_dir():
        assert time.time() < deadline and job_field(job_id, slurm_conf, "JobState") not in DONE_STATES, \
            job_field(job_id, slurm_conf, "JobState")
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", job_id], env=env, check=True, timeout=30)
    deadline, requeued = time.time() + 420, False
    while (state := job_field(job_id, slurm_conf, "JobState")) not in DONE_STATES and time.time() < deadline:
        if state == "PENDING" and job_field(job_id, slurm_conf, "Restarts") not in ("", "0"):
            requeued = True  # Slurm holds a requeued job for a while (BeginTime): release it now
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, timeout=30)
        time.sleep(1)
    log = (tmp_path / f"slurm-{job_id}.out").read_text() if (tmp_path / f"slurm-{job_id}.out").exists() else ""
    assert state == "COMPLETED", f"job {job_id}: {state}\n{log[-4000:]}"
    assert requeued and f"requeueing job {job_id}" in log, log[-4000:]
    assert "requeued by Slurm (restart 1)" in log or "resuming from" in log, log[-4000:]
    expected, losses = losses_by_step(reference), losses_by_step(out)
    assert sorted(losses) == list(range(1, 13)), losses
    for step in range(6, 13):
        assert losses[step] == pytest.approx(expected[step], rel=2e-3), (step, losses, expected)
    assert json.loads((out / "train_results.json").read_text())["global_step"] == 12
