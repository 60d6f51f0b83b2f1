"""The only module that reads launcher environment variables (ours, torchrun's and accelerate's)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardtune.errors import ConfigError


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits, as set by torchrun / the deepspeed launcher / accelerate launch."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or "RANK" in os.environ


def read_rank_env(env: Mapping[str, str] | None = None) -> RankEnv:
    env = os.environ if env is None else env
    return RankEnv(
        rank=int(env.get("RANK", 0)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))),
        master_addr=env.get("MASTER_ADDR"),
        master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
        restart_count=elastic_restart_count(env),
    )


def elastic_restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times torchrun has restarted this job's workers (0 on the first attempt)."""
    env = os.environ if env is None else env
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def inside_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True when a launcher (torchrun, deepspeed, accelerate) already started this process as a rank."""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env


@dataclass(frozen=True)
class LaunchEnv:
    """LLaMA-Factory's launch contract: FORCE_TORCHRUN, NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_*, elastic."""

    force_torchrun: bool = False
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_id: str | None = None
    min_nnodes: int | None = None
    max_nnodes: int | None = None
    max_restarts: int = 0
    cuda_visible_devices: str | None = None
    rdzv_timeout: int | None = None


_INT_VARS = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_PORT", "MIN_NNODES", "MAX_NNODES", "MAX_RESTARTS",
             "RDZV_TIMEOUT")


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Parse the launch variables; a malformed one is an error naming it."""
    env = os.environ if env is None else env
    problems, ints = [], {}
    for name in _INT_VARS:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            ints[name] = int(raw)
        except ValueError:
            problems.append(f"environment variable {name}={raw!r} is not an integer")
    if problems:
        raise ConfigError(*problems)
    return LaunchEnv(
        force_torchrun=env.get("FORCE_TORCHRUN", "0").lower() in ("1", "true", "yes"),
        nnodes=ints.get("NNODES", 1),
        node_rank=ints.get("NODE_RANK", 0),
        nproc_per_node=ints.get("NPROC_PER_NODE"),
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=ints.get("MASTER_PORT"),
        rdzv_id=env.get("RDZV_ID") or None,
        min_nnodes=ints.get("MIN_NNODES"),
        max_nnodes=ints.get("MAX_NNODES"),
        max_restarts=ints.get("MAX_RESTARTS", 0),
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        rdzv_timeout=ints.get("RDZV_TIMEOUT"),
    )


def accelerate_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What `accelerate launch` passed to this worker (ACCELERATE_*, FSDP_*), empty when not under it."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
