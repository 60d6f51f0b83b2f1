"""Where the ranks are and how the global batch is made: the one owner of world-size arithmetic.

``WorldLayout`` is decided once on the launching host (nodes x processes per node, batch sizes) and asked by
everyone else: the launcher (world size), the engines (DeepSpeed's train_batch_size, FSDP's hybrid groups), the
estimate (nodes x ranks per node) and the dry-run report. ``RankEnv`` is one rank's place in a running job.
shardtune has no tensor or pipeline parallelism. With sequence parallelism (``sequence_parallel``, N) each run of N
consecutive ranks shares one sequence (its *sequence group*, inside one node) and the data-parallel ranks are the
world / N sequence groups; otherwise every rank is a data-parallel rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


@dataclass(frozen=True)
class WorldLayout:
    """Nodes x processes per node, and the batch each optimizer step consumes.

    ``uneven_ranks``: the world size of a job whose nodes hold different numbers of ranks (Ray places workers where
    GPUs are free: 12 workers on 8-GPU nodes, a partly busy node). Data parallelism does not mind; ``nodes`` and
    ``procs_per_node`` then only describe this rank's node, and node-shaped groups (hybrid sharding) are refused.
    """

    nodes: int = 1
    procs_per_node: int = 1
    micro_batch: int = 1  # per_device_train_batch_size
    grad_accum: int = 1  # gradient_accumulation_steps
    uneven_ranks: int | None = None
    sequence_parallel: int = 1  # ranks that split one sequence
    expert_parallel: int = 1  # ranks that split each mixture-of-experts layer's experts

    def __post_init__(self) -> None:
        named = {"nodes": self.nodes, "processes per node": self.procs_per_node,
                 "per_device_train_batch_size": self.micro_batch, "gradient_accumulation_steps": self.grad_accum,
                 "sequence_parallel_size": self.sequence_parallel, "expert_parallel_size": self.expert_parallel}
        bad = [f"{name} ({value})" for name, value in named.items() if value < 1]
        if bad:
            raise ValueError(f"world layout: {', '.join(bad)} must be at least 1")

    @classmethod
    def of_ranks(cls, world_size: int, local_world_size: int, micro_batch: int = 1,
                 grad_accum: int = 1) -> WorldLayout:
        """The layout of a running job, from one rank's variables (``local_world_size`` ranks on its node).

        A world that is not a whole number of such nodes was placed unevenly: every rank still gets a layout (a rank
        that raised here while its peers went on would leave them waiting in their first collective).
        """
        per_node = max(1, min(local_world_size, world_size))
        if world_size % per_node:
            return cls(-(-world_size // per_node), per_node, micro_batch, grad_accum, uneven_ranks=world_size)
        return cls(world_size // per_node, per_node, micro_batch, grad_accum)

    @classmethod
    def of_placement(cls, local_world_sizes: Sequence[int], micro_batch: int = 1, grad_accum: int = 1) -> WorldLayout:
        """The layout from every rank's LOCAL_WORLD_SIZE (gathered, so that every rank decides the same)."""
        world_size = len(local_world_sizes)
        sizes = set(local_world_sizes)
        if len(sizes) == 1 and world_size % min(sizes) == 0:
            return cls.of_ranks(world_size, min(sizes), micro_batch, grad_accum)
        # A node of k ranks has k ranks that each say k.
        nodes = max(1, sum(list(local_world_sizes).count(k) // k for k in sizes))
        return cls(nodes, max(sizes), micro_batch, grad_accum, uneven_ranks=world_size)

    @property
    def world_size(self) -> int:
        return self.uneven_ranks if self.uneven_ranks is not None else self.nodes * self.procs_per_node

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data: one per sequence group."""
        return max(1, self.world_size // self.sequence_parallel)

    def sequence_parallel_problems(self) -> list[str]:
        """Why this world cannot be split into sequence groups of ``sequence_parallel`` ranks (empty: it can).
        A group stays inside one node: its all-to-all runs on every attention layer, forward and backward."""
        n, world = self.sequence_parallel, self.world_size
        if n == 1:
            return []
        if world % n:
            return [f"sequence_parallel_size ({n}) does not divide the world size ({world}); use a divisor of it or "
                    f"{-(-world // n) * n} processes"]
        if self.uneven_ranks is not None or self.procs_per_node % n:
            return [f"sequence_parallel_size ({n}) does not divide the processes per node ({self.procs_per_node}): "
                    "a sequence group must stay inside one node; use a divisor of the processes per node"]
        return []

    def expert_parallel_problems(self, experts: int | None = None) -> list[str]:
        """Why this world cannot split ``experts`` experts per layer over ``expert_parallel`` ranks (empty: it can).
        The ranks form a (expert-data-parallel x expert-parallel) grid; dense weights stay sharded over all."""
        n, world = self.expert_parallel, self.world_size
        if n == 1:
            return []
        problems = []
        if world % n:
            problems.append(f"expert_parallel_size ({n}) does not divide the world size ({world}); use a divisor of "
                            f"it or {-(-world // n) * n} processes")
        if experts is not None and experts % n:
            problems.append(f"expert_parallel_size ({n}) does not divide the model's {experts} experts per layer; "
                            "use a divisor of the expert count")
        return problems

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks that hold the same experts (FSDP shards each expert between them)."""
        return max(1, self.world_size // self.expert_parallel)

    def sequence_group_of(self, rank: int) -> tuple[int, ...]:
        """The ranks that share ``rank``'s sequences, in shard order (consecutive ranks, inside one node)."""
        first = rank - rank % self.sequence_parallel
        return tuple(range(first, first + self.sequence_parallel))

    def sequence_groups(self) -> list[tuple[int, ...]]:
        """Every sequence group, in the order each rank must create them (process groups are made collectively)."""
        return [self.sequence_group_of(first) for first in range(0, self.world_size, self.sequence_parallel)]

    def data_parallel_rank(self, rank: int) -> int:
        """Which share of the data ``rank`` reads: every rank of a sequence group reads the same."""
        return rank // self.sequence_parallel

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.data_parallel_size

    def describe_global_batch(self) -> str:
        split = (f" (world {self.world_size} / sequence_parallel_size {self.sequence_parallel})"
                 if self.sequence_parallel > 1 else "")
        return (f"{self.micro_batch} (per_device_train_batch_size) x {self.grad_accum} "
                f"(gradient_accumulation_steps) x {self.data_parallel_size} (data-parallel size{split}) = "
                f"{self.global_batch}")

    def hybrid_groups(self, strategy: str, shard_size: int | None) -> tuple[int, int]:
        """(replicate, shard) group sizes of a hybrid-sharded run; an impossible layout raises ValueError naming
        the numbers. The shard group is a node unless ``shard_size`` says otherwise.

        FSDP1's default groups on a single node make the shard group the whole node and the replica group size 1,
        or with 1 process per node a shard size of 1 that silently becomes NO_SHARD; we never let that happen.
        """
        shard, world = shard_size or self.procs_per_node, self.world_size
        if shard_size is None and self.uneven_ranks is not None:
            raise ValueError(f"{strategy} shards within a node, but this job's {world} ranks are spread unevenly over "
                             "its nodes (different LOCAL_WORLD_SIZE); set fsdp_config.hsdp_shard_size, or place the "
                             "same number of ranks on every node (Ray: placement_strategy STRICT_PACK / "
                             "STRICT_SPREAD, ray_num_workers a multiple of the GPUs per node)")
        if shard < 2:
            raise ValueError(f"{strategy} needs at least 2 processes per shard group, got {shard} (world size "
                             f"{world}); use more processes per node or set fsdp_config.hsdp_shard_size")
        if world % shard:
            raise ValueError(f"{strategy}: shard group size {shard} does not divide world size {world}")
        if world // shard < 2:
            raise ValueError(f"{strategy} with shard group size {shard} and world size {world} has one replica, "
                             "which is FULL_SHARD; use FULL_SHARD, or set fsdp_config.hsdp_shard_size to a divisor "
                             "of the world size")
        return world // shard, shard
