"""USE_RAY=1: Ray Train's TorchTrainer starts the ranks; each runs the same rank code as a torchrun rank.

Why TorchTrainer and not bare actors: it is Ray's own machinery for exactly this (a placement group with
placement_strategy and resources_per_worker, one process group over the workers, NCCL on GPU workers and gloo on
CPU ones, RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR set like torchrun sets them, and FailureConfig restarting the whole
worker group when one worker dies). shardtune keeps its own checkpoints in output_dir, so Ray's checkpoint
reporting is not used: a restarted group resumes from the latest complete checkpoint there.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from shardtune.errors import ConfigError
from shardtune.host import visible_gpu_count
from shardtune.launch import env as launch_env
from shardtune.launch.failures import is_consequence, saved_failure_report
from shardtune.launch.preflight import RunPlan, write_run_plan
from shardtune.launch.ray_plan import RayPlan, build_ray_plan, worker_threads

ATTEMPT_FILE = ".shardtune/ray_attempt.json"  # which attempt of which Ray launch wrote this run folder last
_EXIT_CODE = re.compile(r"shardtune rank (\d+) exited with code (\d+)")


class RankFailed(RuntimeError):
    """A rank's training ended with a non-zero exit code (the rank has already said why)."""


def start_ray_run(plan: RunPlan, debug: bool = False) -> int:
    """Start the Ray run of a checked plan; the run's exit code (2: bad input, 1: a rank failed)."""
    launch = plan.launch
    assert launch is not None
    if "dry_run" in plan.switches:
        from shardtune.launch.report import dry_run_report

        ray_plan = build_ray_plan(plan.config, launch.max_restarts, visible_gpu_count())
        print(dry_run_report(plan, [], ray=ray_plan.describe()))
        return 0
    import ray

    # Ray Train doubles every print of a worker into its own log stream by default; one copy is enough.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    ray.init(**{"include_dashboard": False, **(plan.config.ray_init_kwargs or {})})
    try:
        ray_plan = build_ray_plan(plan.config, launch.max_restarts, ray.cluster_resources().get("GPU", 0))
        missing = missing_resources(ray_plan, ray.cluster_resources())
        if missing:
            raise ConfigError(missing)
        print(f"[shardtune] launching: {ray_plan.describe()}", flush=True)
        failure = fit(ray_plan, write_run_plan(plan), plan.run_dir, debug)
    finally:
        ray.shutdown()
    if failure is None:
        return 0
    # After the shutdown, so that the line comes after the tracebacks Ray's controller forwards.
    print(failure[0], file=sys.stderr, flush=True)
    return failure[1]


def missing_resources(ray_plan: RayPlan, cluster: dict[str, float]) -> str | None:
    """A run the Ray cluster can never place waits forever: say so before starting it."""
    for name, amount in sorted(ray_plan.resources_per_worker.items()):
        needed = amount * ray_plan.num_workers
        if needed > cluster.get(name, 0):
            return (f"ray_num_workers ({ray_plan.num_workers}) x resources_per_worker {name}: {amount:g} needs "
                    f"{needed:g} {name}, the Ray cluster has {cluster.get(name, 0):g}; lower ray_num_workers or "
                    "resources_per_worker, or add nodes to the cluster")
    return None


def fit(ray_plan: RayPlan, plan_path: Path, run_dir: Path, debug: bool) -> tuple[str, int] | None:
    """Run the TorchTrainer; None when it finished, else the failure's line and exit code."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    loop_config = {"plan": str(plan_path.resolve()), "cwd": os.getcwd(), "launch_id": uuid.uuid4().hex,
                   "debug": debug, "resources": dict(ray_plan.resources_per_worker)}
    trainer = TorchTrainer(
        ray_rank, train_loop_config=loop_config,
        torch_config=TorchConfig(backend=ray_plan.backend, timeout_s=ray_plan.timeout_s),
        scaling_config=ScalingConfig(**ray_plan.scaling_args()),
        run_config=RunConfig(name=ray_plan.run_name, storage_path=ray_plan.storage_path,
                             failure_config=FailureConfig(max_failures=ray_plan.max_failures)))
    started = time.time()
    try:
        trainer.fit()
    except Exception as err:  # Ray wraps what the workers raised: TrainingFailedError and its kin
        if debug:
            raise
        return failure_line(err, run_dir, ray_plan.num_workers, started)
    return None


def failure_line(err: BaseException, run_dir: Path, workers: int, started: float) -> tuple[str, int]:
    """One line for a failed Ray run, as for torchrun: the rank's own report when it wrote one, and the exit code."""
    # Ray Train's WorkerGroupError holds each failed worker's exception by rank.
    failures: dict[int, BaseException] = getattr(err, "worker_failures", None) or {}
    text = "\n".join([str(err), *(f"{type(e).__name__}: {e}" for e in failures.values())])
    # A rank that failed in shardtune's code raised RankFailed; any other failure of a worker (Ray's failed health
    # check, ActorDiedError) means its process is gone.
    dead = sorted(rank for rank, e in failures.items() if not _EXIT_CODE.search(str(e)))
    codes = [int(m.group(2)) for m in _EXIT_CODE.finditer(text)]
    reports = [r for rank in range(workers) if (r := saved_failure_report(run_dir, rank, started))]
    own = [r for r in reports if not is_consequence(r)]
    if own:
        return own[0], max(codes or [1])
    if dead or not (reports or codes):  # a worker that was killed writes nothing: the others only lost it
        who = f" (rank {dead[0]})" if dead else ""
        return (f"shardtune: error: a Ray worker{who} died without a report (killed, or out of memory); with "
                "MAX_RESTARTS=N Ray restarts the workers, which resume from the latest checkpoint"), 1
    if reports:
        return reports[0], max(codes or [1])
    # The rank printed its own error (bad input: exit code 2) and wrote no file.
    return f"shardtune: error: the Ray run failed: a rank exited with code {max(codes)} (its message is above)", \
        max(codes)


def ray_rank(loop_config: dict[str, Any]) -> None:
    """One rank, run by Ray Train in each worker: the torchrun rank's code on Ray's process group."""
    from shardtune.launch.worker import rank_plan, resumed_after_restart, run_rank

    os.chdir(loop_config["cwd"])  # Ray starts workers in its own folder; paths in the config are the user's
    rank_env = launch_env.read_rank_env()
    use_node_threads(loop_config.get("resources", {}), rank_env.local_world_size)
    plan = rank_plan([loop_config["plan"]], rank_env)
    attempt = attempt_number(plan.run_dir, loop_config["launch_id"], rank_env.rank, rank_env.local_rank)
    plan = resumed_after_restart(plan, attempt, rank_env.rank, "Ray")
    code = run_rank(plan, rank_env, bool(loop_config["debug"]))
    if code != 0:
        raise RankFailed(f"shardtune rank {rank_env.rank} exited with code {code}")


def use_node_threads(resources: dict[str, float], local_world_size: int) -> None:
    """Threads for this worker's share of its node's CPUs (Ray gives a worker that requested no CPU one)."""
    threads = worker_threads(resources, launch_env.node_cpus(), local_world_size)
    if threads is None:
        return
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes this worker starts (data loading)
    torch.set_num_threads(threads)


def attempt_number(run_dir: Path, launch_id: str, rank: int, local_rank: int) -> int:
    """How many times Ray already started this launch's worker group (0 on the first attempt).

    Ray Train tells a worker no attempt count, so rank 0 keeps one in the run folder and tells the other ranks.
    """
    import torch
    import torch.distributed as dist

    attempt = 0
    path = run_dir / ATTEMPT_FILE
    if rank == 0:
        try:
            seen = json.loads(path.read_text())
            attempt = int(seen["attempt"]) if seen.get("launch") == launch_id else 0
        except (OSError, ValueError, KeyError, TypeError):
            attempt = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"launch": launch_id, "attempt": attempt + 1}))
    if torch.cuda.is_available():
        from shardtune.engines.distributed import rank_device

        torch.cuda.set_device(rank_device(local_rank, torch.cuda.device_count()))  # NCCL uses the current device
    box: list[Any] = [attempt]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])
