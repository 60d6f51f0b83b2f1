"""How Ray Train starts the ranks, decided from the config's Ray keys and MAX_RESTARTS (pure, apart from
``ray_init_function``, which only looks Ray up).

LLaMA-Factory's keys map onto Ray Train's own objects: ray_num_workers and resources_per_worker and
placement_strategy onto ``ScalingConfig``, ray_run_name and ray_storage_path onto ``RunConfig``, MAX_RESTARTS onto
``FailureConfig(max_failures)`` (the same variable that lets torchrun restart its workers), ddp_timeout onto
``TorchConfig(timeout_s)``; ray_init_kwargs go to ``ray.init``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtune.config.schema import TrainConfig
from shardtune.paths import home_expanded

RAY_PIN = "ray[train]==2.60.0"  # the version requirements.txt pins and the tests ran with


@dataclass(frozen=True)
class RayPlan:
    """Everything the launching host hands to Ray: ``ray.init`` arguments and the TorchTrainer's configs."""

    num_workers: int
    resources_per_worker: dict[str, float]
    placement_strategy: str
    use_gpu: bool
    backend: str  # as shardtune's own ranks: NCCL with gloo for host tensors on GPU workers, gloo on CPU workers
    storage_path: str
    run_name: str
    max_failures: int
    timeout_s: int
    init_kwargs: dict[str, Any] = field(default_factory=dict)

    def scaling_args(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "use_gpu": self.use_gpu,
                "resources_per_worker": dict(self.resources_per_worker),
                "placement_strategy": self.placement_strategy}

    def describe(self) -> str:
        resources = ", ".join(f"{k}: {v:g}" for k, v in sorted(self.resources_per_worker.items()))
        return (f"Ray Train TorchTrainer: {self.num_workers} workers x {{{resources}}} ({self.backend}), placement "
                f"{self.placement_strategy}, max_failures {self.max_failures} (MAX_RESTARTS), run state in "
                f"{self.storage_path}/{self.run_name}")


def ray_init_function() -> Callable[..., Any] | None:
    """ray.init, or None when Ray Train is not installed on this host."""
    try:
        import ray
        import ray.train.torch  # noqa: F401 - TorchTrainer must import too
    except ImportError:
        return None
    return ray.init


def build_ray_plan(config: TrainConfig, max_restarts: int, cluster_gpus: float) -> RayPlan:
    """The plan for ``config``; ``cluster_gpus``: the GPUs the Ray cluster has (decides the default resources)."""
    from shardtune.engines.distributed import process_group_backend

    resources = {str(k): float(v) for k, v in (config.resources_per_worker or {}).items()}
    if not resources:
        resources = {"GPU": 1.0} if cluster_gpus > 0 else {"CPU": 1.0}
    use_gpu = resources.get("GPU", 0.0) > 0
    default_name = Path(config.output_dir or "shardtune").resolve().name
    return RayPlan(num_workers=config.ray_num_workers, resources_per_worker=resources,
                   placement_strategy=config.placement_strategy, use_gpu=use_gpu,
                   backend=process_group_backend("cuda" if use_gpu else "cpu"),
                   storage_path=str(home_expanded(config.ray_storage_path).resolve()),
                   run_name=config.ray_run_name or default_name, max_failures=max_restarts,
                   timeout_s=config.ddp_timeout, init_kwargs=dict(config.ray_init_kwargs or {}))


def worker_threads(resources: dict[str, float], node_cpus: int, local_world_size: int) -> int | None:
    """CPU threads for one Ray worker's torch and OpenMP; None when it asked for CPUs (Ray then sets OMP_NUM_THREADS
    to them). A GPU worker that asked for none gets OMP_NUM_THREADS=1 from Ray: it shares its node's CPUs with the
    node's other workers instead, as torchrun's ranks do (launch/supervise.py)."""
    if resources.get("CPU", 0) >= 1:
        return None
    return max(1, node_cpus // max(1, local_world_size))


def ray_problems(config: TrainConfig, ray_init: Callable[..., Any] | None) -> list[str]:
    """What is wrong with the Ray keys, checked before Ray starts anything. ``ray_init``: ray.init (None when Ray
    is not installed), whose signature tells the arguments ray_init_kwargs may name."""
    if ray_init is None:
        return [f"USE_RAY=1 needs Ray Train on this host: pip install '{RAY_PIN}' (or unset USE_RAY)"]
    problems = []
    for name, amount in (config.resources_per_worker or {}).items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            problems.append(f"resources_per_worker: {name}: {amount!r} is not a non-negative number")
    gpus = (config.resources_per_worker or {}).get("GPU", 0)
    if isinstance(gpus, (int, float)) and not isinstance(gpus, bool) and gpus > 1:
        problems.append(f"resources_per_worker: GPU: {gpus}: shardtune runs one rank per device; give each worker "
                        "GPU: 1 and raise ray_num_workers")
    elif isinstance(gpus, (int, float)) and not isinstance(gpus, bool) and 0 < gpus < 1:
        # Ray would place 1/GPU workers on one GPU, and NCCL refuses two ranks on one device ("Duplicate GPU").
        problems.append(f"resources_per_worker: GPU: {gpus}: a fraction of a GPU per worker puts several ranks on "
                        "one GPU, which NCCL refuses; give each worker GPU: 1 (or CPU workers without GPU)")
    # ray.init also takes **kwargs, but only for its private "_"-prefixed settings: any other name is a typo.
    named = {n for n, p in inspect.signature(ray_init).parameters.items() if p.kind is not p.VAR_KEYWORD}
    unknown = [k for k in (config.ray_init_kwargs or {}) if k not in named and not str(k).startswith("_")]
    if unknown:
        problems.append(f"ray_init_kwargs: {', '.join(map(str, unknown))} not an argument of ray.init; see "
                        "https://docs.ray.io/en/latest/ray-core/api/doc/ray.init.html")
    return problems
