"""Process-group setup and the collectives every multi-process engine shares."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardtune.world import RankEnv


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str


def init_distributed(rank_env: RankEnv, timeout_s: int) -> DistContext:
    """Join the process group the launcher set up: NCCL on GPUs, gloo on CPU."""
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank_env.local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout, **restart_store(rank_env, timeout))
    return DistContext(rank=dist.get_rank(), local_rank=rank_env.local_rank, world_size=dist.get_world_size(),
                       local_world_size=rank_env.local_world_size, device=device, backend=backend)


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
            dist.destroy_process_group()
