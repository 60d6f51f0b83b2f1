"""USE_RAY=1: the launch variable, the Ray plan built from the keys (pure), its checks, and the failure line."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shardtune.config.load import build_config
from shardtune.errors import ConfigError
from shardtune.launch.env import read_launch_env
from shardtune.launch.failures import save_rank_failure
from shardtune.launch.ray_job import failure_line, missing_resources
from shardtune.launch.ray_plan import build_ray_plan, ray_problems, worker_threads
from shardtune.launch.torchrun import plan_launch
from tests.conftest import run_cli


def fake_ray_init(address=None, *, num_cpus=None, num_gpus=None, runtime_env=None, **kwargs):
    """ray.init's shape: named arguments and **kwargs for its private settings."""


def config(**values):
    return build_config({"model_name_or_path": "m", "dataset": "demo", "output_dir": "/runs/exp1", **values})


def test_use_ray_is_read_and_reaches_the_launch_plan():
    assert plan_launch(read_launch_env({"USE_RAY": "1"}), visible_gpus=0, free_port=1).use_ray
    assert not plan_launch(read_launch_env({}), visible_gpus=0, free_port=1).use_ray


@pytest.mark.parametrize(("env", "fragment"), [
    ({"USE_RAY": "maybe"}, "USE_RAY='maybe' is not 1/0"),
    ({"USE_RAY": "1", "NPROC_PER_NODE": "2"}, "NPROC_PER_NODE=2 is set with USE_RAY=1: Ray places the workers"),
    ({"USE_RAY": "1", "SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1",
      "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "USE_RAY=1 inside a SLURM job"),
])
def test_bad_ray_launch_environment(env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        read_launch_env(env)


def test_ray_keys_parse_as_llamafactory_writes_them():
    c = config(ray_num_workers="4", resources_per_worker='{"GPU": 1, "CPU": 8}', placement_strategy="SPREAD",
               ray_init_kwargs='{"address": "auto"}', ray_run_name="exp")
    assert (c.ray_num_workers, c.resources_per_worker, c.ray_init_kwargs) == (4, {"GPU": 1, "CPU": 8},
                                                                            {"address": "auto"})
    with pytest.raises(ConfigError, match="placement_strategy"):
        config(placement_strategy="FAR")
    with pytest.raises(ConfigError, match="ray_storage_filesystem"):
        config(ray_storage_filesystem="s3")


def test_plan_maps_keys_onto_ray_train_configs():
    plan = build_ray_plan(config(ray_num_workers=4, resources_per_worker={"GPU": 1, "CPU": 8},
                                 placement_strategy="STRICT_SPREAD", ray_storage_path="/shared/ray", ddp_timeout=600,
                                 ray_init_kwargs={"address": "auto"}), max_restarts=3, cluster_gpus=0)
    assert plan.scaling_args() == {"num_workers": 4, "use_gpu": True, "resources_per_worker": {"GPU": 1.0, "CPU": 8.0},
                                   "placement_strategy": "STRICT_SPREAD"}
    assert (plan.backend, plan.max_failures, plan.timeout_s, plan.storage_path, plan.run_name) == \
        ("cpu:gloo,cuda:nccl", 3, 600, "/shared/ray", "exp1")
    assert plan.init_kwargs == {"address": "auto"}


@pytest.mark.parametrize(("gpus", "resources", "backend"), [(2, {"GPU": 1.0}, "cpu:gloo,cuda:nccl"),
                                                             (0, {"CPU": 1.0}, "gloo")])
def test_default_resources_follow_the_cluster(gpus, resources, backend):
    plan = build_ray_plan(config(ray_num_workers=2), max_restarts=0, cluster_gpus=gpus)
    assert (plan.resources_per_worker, plan.backend, plan.use_gpu) == (resources, backend, gpus > 0)


def test_ray_key_problems_are_named():
    problems = ray_problems(config(resources_per_worker={"GPU": 2, "CPU": -1},
                                   ray_init_kwargs={"num_cpu": 2, "_temp_dir": "/t", "num_cpus": 2}), fake_ray_init)
    assert problems == ["resources_per_worker: CPU: -1 is not a non-negative number",
                        "resources_per_worker: GPU: 2: shardtune runs one rank per device; give each worker GPU: 1 "
                        "and raise ray_num_workers",
                        "ray_init_kwargs: num_cpu not an argument of ray.init; see "
                        "https://docs.ray.io/en/latest/ray-core/api/doc/ray.init.html"]
    assert "pip install 'ray[train]==" in ray_problems(config(), None)[0]
    assert ray_problems(config(), fake_ray_init) == []


def test_a_run_the_cluster_cannot_place_is_refused():
    plan = build_ray_plan(config(ray_num_workers=3), max_restarts=0, cluster_gpus=0)
    assert missing_resources(plan, {"CPU": 2.0}) == (
        "ray_num_workers (3) x resources_per_worker CPU: 1 needs 3 CPU, the Ray cluster has 2; lower "
        "ray_num_workers or resources_per_worker, or add nodes to the cluster")
    assert missing_resources(plan, {"CPU": 3.0}) is None


def test_failure_line_is_the_failing_ranks_own_report(tmp_path: Path):
    started = time.time() - 1
    save_rank_failure(RuntimeError("Connection closed by peer"), 0, tmp_path, 1800)
    save_rank_failure(ValueError("bad batch"), 1, tmp_path, 1800)
    line, code = failure_line(RuntimeError("Training failed"), tmp_path, 2, started)
    assert line.startswith("[shardtune] rank 1 failed: ValueError: bad batch (full traceback: ") and code == 1
    line, code = failure_line(RuntimeError("shardtune rank 0 exited with code 2"), tmp_path / "none", 2, started)
    assert code == 2 and "exited with code 2" in line
    from ray.exceptions import ActorDiedError
    from ray.train.v2.api.exceptions import WorkerGroupError

    died = WorkerGroupError("Training failed", {1: ActorDiedError(), 0: RuntimeError("shardtune rank 0 exited with "
                                                                                     "code 1")})
    assert failure_line(died, tmp_path, 2, started)[0].startswith("[shardtune] rank 1 failed: ValueError")
    (tmp_path / ".shardtune" / "rank-1-error.txt").unlink()
    line, code = failure_line(died, tmp_path, 2, started)  # rank 0 only lost the killed worker
    assert line.startswith("shardtune: error: a Ray worker (rank 1) died without a report") and code == 1
    assert "\n" not in line


def test_check_under_use_ray_reports_every_problem_in_one_round(tmp_path: Path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: org/m\ndataset: demo\noutput_dir: o\nplacement_strategy: FAR\n"
                   "ray_init_kwargs: {num_cpu: 2}\n")
    result = run_cli("check", str(cfg), USE_RAY="1", NNODES="2", MASTER_PORT="29500", timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert "NNODES=2 is set with USE_RAY=1" in lines[0]
    assert "placement_strategy" in result.stderr and "ray_init_kwargs: num_cpu not an argument" in result.stderr


def test_a_fraction_of_a_gpu_per_worker_is_refused():
    problems = ray_problems(config(resources_per_worker={"GPU": 0.5}), fake_ray_init)
    assert problems == ["resources_per_worker: GPU: 0.5: a fraction of a GPU per worker puts several ranks on one "
                        "GPU, which NCCL refuses; give each worker GPU: 1 (or CPU workers without GPU)"]
    assert ray_problems(config(resources_per_worker={"GPU": 1, "CPU": 0.5}), fake_ray_init) == []


def test_gpu_workers_share_their_node_cpus():
    """Ray gives a worker that requested no CPU OMP_NUM_THREADS=1; shardtune gives it its share of the node."""
    assert worker_threads({"GPU": 1.0}, node_cpus=96, local_world_size=8) == 12
    assert worker_threads({"GPU": 1.0, "CPU": 0.5}, node_cpus=96, local_world_size=8) == 12
    assert worker_threads({"GPU": 1.0, "CPU": 6.0}, node_cpus=96, local_world_size=8) is None  # Ray sets 6
    assert worker_threads({"GPU": 1.0}, node_cpus=4, local_world_size=8) == 1


def test_a_rank_placed_unevenly_gets_its_plan(tmp_path):
    """12 workers on 8-GPU nodes: the ranks on the full node used to raise while the others waited for them."""
    from shardtune.engines.engine_plan import EnginePlan
    from shardtune.launch import worker
    from shardtune.launch.preflight import RunPlan, write_run_plan
    from shardtune.world import RankEnv, WorldLayout

    plan = RunPlan(config(output_dir=str(tmp_path)), EnginePlan("ddp"), WorldLayout(1, 12))
    path = write_run_plan(plan)
    for local in (8, 4):
        ranked = worker.rank_plan([str(path)], RankEnv(rank=0, world_size=12, local_world_size=local))
        assert ranked.layout.world_size == 12
