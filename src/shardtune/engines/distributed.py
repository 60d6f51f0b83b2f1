"""Process-group setup and the collectives every multi-process engine shares."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardtune.errors import ConfigError
from shardtune.host import cuda_visible_devices
from shardtune.world import RankEnv


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    # False when the group existed before this run joined it (Ray Train's, a driver's that trains several runs in
    # one group): its creator destroys it, so engines built on it one after another share it.
    owns_group: bool = True


def init_distributed(rank_env: RankEnv, timeout_s: int) -> DistContext:
    """Join the process group the launcher set up: NCCL for GPU tensors (with gloo for host tensors), gloo on CPU."""
    device = rank_device(rank_env.local_rank, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = process_group_backend(device.type)
    timeout = datetime.timedelta(seconds=timeout_s)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend=backend, timeout=timeout, **restart_store(rank_env, timeout))
    return DistContext(rank=dist.get_rank(), local_rank=rank_env.local_rank, world_size=dist.get_world_size(),
                       local_world_size=rank_env.local_world_size, device=device, backend=backend,
                       owns_group=owns_group)


def process_group_backend(device_type: str) -> str:
    """The backend of each tensor device the ranks' collectives see.

    On GPUs NCCL moves the CUDA tensors, and gloo the host ones: FSDP2 with CPU offload clips gradients and gathers
    the full state from shards that live on the host, and an NCCL-only group refuses those collectives ("No backend
    type associated with device type cpu", torch issue 148532; torchtune uses the same pair of backends).
    """
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def group_backends(backend: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> {device type: backend}; a bare name serves the device types it supports."""
    if ":" not in backend:
        return {"nccl": {"cuda": "nccl"}, "gloo": {"cpu": "gloo", "cuda": "gloo"}}.get(backend, {"cpu": backend})
    pairs = (item.split(":", 1) for item in backend.split(",") if item.strip())
    return {device.strip(): name.strip() for device, name in pairs}


def rank_device(local_rank: int, cuda_devices: int) -> torch.device:
    """This rank's device: the GPU of its LOCAL_RANK; the one GPU a process sees when it was given exactly one
    (``srun --gpus-per-task=1``, a GPU per container), whatever its LOCAL_RANK; the host without GPUs."""
    if cuda_devices == 0:
        return torch.device("cpu")
    if local_rank < cuda_devices:
        return torch.device("cuda", local_rank)
    if cuda_devices == 1:
        return torch.device("cuda", 0)
    visible = cuda_visible_devices()
    raise ConfigError(f"rank with LOCAL_RANK={local_rank} sees {cuda_devices} GPUs"
                      + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                      + f": start at most {cuda_devices} processes on this node (NPROC_PER_NODE), or give each "
                      "process all of the node's GPUs or exactly one")


def gather_local_world_sizes(ctx: DistContext) -> list[int]:
    """Every rank's LOCAL_WORLD_SIZE, in rank order (one collective)."""
    sizes = torch.zeros(ctx.world_size, dtype=torch.int64, device=ctx.device)
    sizes[ctx.rank] = ctx.local_world_size
    dist.all_reduce(sizes)
    return [int(size) for size in sizes.tolist()]


def restart_store(rank_env: RankEnv, timeout: datetime.timedelta) -> dict:
    """After a torchrun restart, a store namespace of this attempt's own.

    torchrun keeps one store across restarts; without a fresh prefix the new ranks can read the dead ranks'
    addresses left in it and wait on them forever (seen with gloo).
    """
    if rank_env.restart_count == 0 or rank_env.master_addr is None or rank_env.master_port is None:
        return {}
    store = dist.TCPStore(rank_env.master_addr, rank_env.master_port, is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"shardtune/restart-{rank_env.restart_count}", store),
            "rank": rank_env.rank, "world_size": rank_env.world_size}


class DistributedMixin:
    """Topology and collectives for engines that run in a torch.distributed process group."""

    ctx: DistContext

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def barrier(self) -> None:
        dist.barrier()

    def gather_objects(self, value: object) -> list[object]:
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def close(self) -> None:
        # The barrier keeps a rank from closing its sockets while a peer still waits on it. Destroying the
        # group does not stop gloo's worker threads while the engine still holds the group object; a rank
        # therefore leaves through launch.worker.leave_rank, which never starts interpreter shutdown.
        if dist.is_initialized():
            dist.barrier()
            if self.ctx.owns_group:
                dist.destroy_process_group()
