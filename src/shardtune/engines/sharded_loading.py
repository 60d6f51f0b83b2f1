"""Fill a sharded model from its weights files one tensor at a time: FSDP2, FSDP1 and ZeRO-3 share this.

A rank never holds more than its shard plus the one tensor being loaded. Two ways to get that tensor:
``rank0_reads`` (accelerate's ``cpu_ram_efficient_loading``): rank 0 alone reads the files and broadcasts each
tensor from the engine's device (NCCL only moves device tensors); otherwise every rank reads only the block of
each tensor it keeps, and no collective runs at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardtune.model.source import Skeleton, named_checkpoint_states


@dataclass
class ShardedLoad:
    """One skeleton being filled on this rank."""

    skeleton: Skeleton
    device: torch.device
    rank: int
    rank0_reads: bool
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # adapter weights with their starting values
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # non-persistent buffers (rotary frequencies)

    @classmethod
    def start(cls, skeleton: Skeleton, device: torch.device, rank: int, rank0_reads: bool) -> ShardedLoad:
        """Take what the skeleton holds for real before an engine replaces its tensors with empty ones."""
        return cls(skeleton, device, rank, rank0_reads, skeleton.initial_values(), skeleton.non_persistent_buffers())

    @property
    def bytes_read(self) -> int:
        return self.skeleton.weights.bytes_read

    def full_tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The whole tensor ``name`` on the engine's device in ``like``'s dtype, the same on every rank."""
        if name in self.initial:
            return self.initial[name].to(self.device, like.dtype)
        stored = self.skeleton.checkpoint_names[name]
        if not self.rank0_reads:
            return self.skeleton.read(stored).to(self.device, like.dtype)
        if self.rank == 0:
            full = self.skeleton.read(stored).to(self.device, like.dtype).contiguous()
        else:
            full = torch.empty(tuple(like.shape), dtype=like.dtype, device=self.device)
        dist.broadcast(full, src=0)
        return full

    def block(self, name: str, like: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The part of tensor ``name`` at ``offsets`` with ``shape``; only that part is read when ranks read."""
        if name in self.initial or self.rank0_reads:
            return _narrow(self.full_tensor(name, like), offsets, shape)
        stored = self.skeleton.checkpoint_names[name]
        return self.skeleton.read_slice(stored, offsets, shape).to(self.device, like.dtype)

    def restore_buffers(self, model: torch.nn.Module, prefix: str = "", recurse: bool = True) -> None:
        """Put back the non-persistent buffers an engine's ``to_empty`` wiped (``prefix``: the module's name)."""
        modules = model.named_modules() if recurse else iter([("", model)])
        for module_name, module in modules:
            for name in list(module._non_persistent_buffers_set):
                full = ".".join(n for n in (prefix, module_name, name) if n)
                if full in self.buffers and module._buffers.get(name) is not None:
                    module._buffers[name] = self.buffers[full].to(self.device)


def _narrow(full: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(offsets, shape, strict=True)):
        full = full.narrow(dim, start, size)
    return full


def local_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's local tensor of ``param`` and where it sits in the whole (a plain tensor: all of it)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param.data, (0,) * param.dim(), tuple(param.shape)
    shape, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(offsets), tuple(shape)


def fill_fully_sharded(model: torch.nn.Module, load: ShardedLoad, storage: torch.device) -> None:
    """FSDP2: give the sharded meta parameters storage (the device, or the host when offloaded), then copy in
    each rank's block."""
    model.to_empty(device=storage)
    load.restore_buffers(model)
    with torch.no_grad():
        for name, tensor in named_checkpoint_states(model):
            local, offsets, shape = local_block(tensor)
            local.copy_(load.block(name, tensor, offsets, shape))


def fsdp1_param_init(model: torch.nn.Module, load: ShardedLoad) -> Callable[[torch.nn.Module], None]:
    """FSDP1's ``param_init_fn``: called for each module of a unit just before the unit is flattened and sharded,
    so a rank holds one unit in full at a time. Tied parameters get the tensor made for their first module."""
    prefixes = {id(m): name for name, m in model.named_modules()}
    made: dict[int, torch.nn.Parameter] = {}

    def materialize(module: torch.nn.Module) -> None:
        prefix = prefixes.get(id(module), "")
        with torch.no_grad():
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                if id(param) not in made:
                    full_name = f"{prefix}.{name}" if prefix else name
                    value = load.full_tensor(full_name, param)
                    made[id(param)] = torch.nn.Parameter(value.clone(), requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta and name not in module._non_persistent_buffers_set:
                    module._buffers[name] = load.full_tensor(f"{prefix}.{name}" if prefix else name, buffer).clone()
        load.restore_buffers(module, prefix, recurse=False)

    return materialize


def fill_zero3(model: torch.nn.Module, load: ShardedLoad) -> None:
    """ZeRO-3: each partitioned parameter is gathered alone, rank 0 writes the file's values, and leaving the
    context broadcasts them and partitions again. Adapter weights are not partitioned yet: they keep their values."""
    import deepspeed

    with torch.no_grad():
        for name, param in model.named_parameters():
            stored = load.skeleton.checkpoint_names.get(name)
            if stored is None:
                continue
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if load.rank == 0:
                    param.data.copy_(load.skeleton.read(stored))
