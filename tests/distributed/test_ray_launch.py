"""USE_RAY=1 on a real local Ray cluster (a head with 2 CPUs, two CPU workers): the same losses as torchrun, and a
killed worker under MAX_RESTARTS restarts the group, which resumes from the latest checkpoint."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import cli_env, run_and_kill_a_worker, run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

RUN = ("examples/tiny/sft_full.yaml", "max_steps=80", "save_steps=10", "logging_steps=1", "do_eval=false",
       "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=80", "gradient_accumulation_steps=2",
       "per_device_train_batch_size=2", "learning_rate=1e-3", "lr_scheduler_type=cosine", "warmup_steps=1")
RAY = ("ray_num_workers=2", 'ray_init_kwargs={"num_cpus": 2}')


def losses_by_step(out: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs the steps after its checkpoint again)."""
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return {r["current_steps"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def torchrun_run(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("torchrun")
    result = run_cli("train", *RUN, f"model_name_or_path={tiny_model_dir}", f"output_dir={out}",
                     FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.fixture
def ray_temp_dir():
    """Ray's session folder (logs, sockets), which a local cluster leaves behind: short (its socket paths must fit
    108 bytes) and removed after the test."""
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_ray_run_matches_torchrun_losses(torchrun_run, tiny_model_dir, tmp_path, ray_temp_dir):
    out = tmp_path / "ray"
    result = run_cli("train", *RUN, "ray_num_workers=2",
                     f'ray_init_kwargs={{"num_cpus": 2, "_temp_dir": "{ray_temp_dir}"}}',
                     f"model_name_or_path={tiny_model_dir}", f"output_dir={out}",
                     f"ray_storage_path={tmp_path / 'ray_state'}", USE_RAY="1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Ray Train TorchTrainer: 2 workers x {CPU: 1} (gloo), placement PACK" in result.stdout
    expected, got = losses_by_step(torchrun_run), losses_by_step(out)
    assert sorted(got) == list(range(1, 81))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got[step], expected[step])
    results = json.loads((out / "train_results.json").read_text())
    assert results["world_size"] == 2 and results["global_step"] == 80
    assert (tmp_path / "ray_state" / "ray").is_dir(), "Ray Train keeps its run state under ray_storage_path"


@pytest.mark.matrix  # about 90 s on 2 cores
def test_killed_ray_worker_restarts_the_group_and_resumes(torchrun_run, tiny_model_dir, tmp_path):
    """SIGKILL one Ray worker after checkpoint-10 (of 80 steps): Ray (MAX_RESTARTS=1) restarts both workers, which
    resume from the latest complete checkpoint instead of wiping output_dir (overwrite_output_dir is true), and the
    run ends with the uninterrupted run's losses."""
    out = tmp_path / "ray"
    argv = [sys.executable, "-m", "shardtune", "train", *RUN, *RAY, f"model_name_or_path={tiny_model_dir}",
            f"output_dir={out}", f"ray_storage_path={tmp_path / 'ray_state'}", "overwrite_output_dir=true"]
    code, stdout, stderr = run_and_kill_a_worker(argv, cli_env(USE_RAY="1", MAX_RESTARTS="1"), out / "checkpoint-10",
                                                 is_ray_worker, finish_timeout=500)
    (tmp_path / "driver.log").write_text(stdout + stderr)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    # Rank 0's count of the group's starts (Ray's log forwarding to the driver is not guaranteed to be complete).
    assert json.loads((out / ".shardtune" / "ray_attempt.json").read_text())["attempt"] == 2, tmp_path / "driver.log"
    expected, got = losses_by_step(torchrun_run), losses_by_step(out)
    assert sorted(got) == list(range(1, 81))
    for step in range(11, 81):
        assert got[step] == pytest.approx(expected[step], rel=1e-3), (step, got[step], expected[step])


def test_killed_ray_worker_without_restarts_is_one_line(tiny_model_dir, tmp_path):
    """Without MAX_RESTARTS the run stops: exit code 1 and, last on stderr, one line naming the dead worker (the
    surviving rank only lost its peer, so its own report is not the cause)."""
    out = tmp_path / "ray"
    argv = [sys.executable, "-m", "shardtune", "train", *RUN, *RAY, f"model_name_or_path={tiny_model_dir}",
            f"output_dir={out}", f"ray_storage_path={tmp_path / 'ray_state'}"]
    code, _, stderr = run_and_kill_a_worker(argv, cli_env(USE_RAY="1"), out / "checkpoint-10", is_ray_worker,
                                            finish_timeout=300)
    assert code == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("shardtune: error: a Ray worker (rank "), stderr[-3000:]
    assert "died without a report (killed, or out of memory)" in stderr.strip().splitlines()[-1]


def is_ray_worker(cmdline: str) -> bool:
    """A Ray Train worker process of the job's own local Ray instance (Ray sets its process title)."""
    return cmdline.startswith("ray::RayTrainWorker")
