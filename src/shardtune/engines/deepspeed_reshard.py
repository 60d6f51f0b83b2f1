"""Resume a ZeRO-1/2 checkpoint on a different number of processes, each rank reading only what it keeps.

ZeRO-1/2 keep the full module weights in ``mp_rank_00_model_states.pt`` but split the fp32 master weights and
the Adam moments into one flat partition per rank and parameter group. DeepSpeed refuses to load those
partitions on another world size, and its universal conversion (``ds_to_universal``) was seen to assign our
two-group layout's slices to the wrong parameters (weights off by up to 0.6). So the conversion is ours:

1. where each parameter lives in the old files: per group, the old ranks' partitions concatenated form one
   flat tensor holding the parameters in ``param_shapes`` order, each followed by its alignment padding (the
   layout ``deepspeed.utils.zero_to_fp32`` reads);
2. DeepSpeed loads the module weights and LR scheduler without optimizer state (it then fills the fp32
   partitions from the module weights);
3. for each parameter that overlaps this rank's new partition, only the overlapping range of the fp32 weight
   and moments is copied from the old partitions. The offsets come from the live optimizer's flat layout
   (``round_robin_bit16_groups`` and ``round_robin_bit16_offsets``, DeepSpeed 0.19): with
   ``round_robin_gradients`` (on in our presets) that order depends on the world size, and DeepSpeed's own
   per-parameter mapping (``param._hp_mapping``, behind ``safe_set_full_optimizer_state``) does not follow it
   when no parameter needs alignment padding - which is also why its universal conversion went wrong.

The old files are memory-mapped (``torch.load(mmap=True, weights_only=True)``, with only DeepSpeed's three plain
record classes allowed): a rank's reads touch the pages of its own slices, about 1/N of the optimizer state,
instead of every rank loading every shard.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
KEYS = ("fp32", *MOMENTS)


def load_mapped(path: Path) -> dict[str, Any]:
    """A DeepSpeed checkpoint file, tensors memory-mapped (nothing read until used), plain data only."""
    from shardtune.engines.safe_load import deepspeed_record_classes

    with torch.serialization.safe_globals(deepspeed_record_classes()):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def shard_files(stage_dir: Path) -> list[Path]:
    files = list(stage_dir.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    return sorted(files, key=_shard_rank)


def _shard_rank(file: Path) -> int:
    """The rank in a name the glob in ``shard_files`` matched."""
    match = re.search(r"zero_pp_rank_(\d+)_", file.name)
    if match is None:
        raise ValueError(f"{file.name} is not a DeepSpeed ZeRO shard file name")
    return int(match.group(1))


@dataclass(frozen=True)
class SavedParam:
    group: int
    offset: int  # in the group's flat tensor: all old partitions concatenated
    shape: torch.Size


@dataclass
class OldShards:
    """The old ranks' optimizer partitions (memory-mapped) and where each parameter lives in them."""

    partitions: list[dict[str, list[torch.Tensor]]]  # old rank -> key -> per-group flat partition
    params: dict[str, SavedParam]
    step: Any  # Adam's step count, as the optimizer stored it
    group_settings: list[dict[str, Any]]  # each group's lr (as the scheduler left it), betas, eps, weight decay
    elements_read: int = field(default=0)  # for tests and logs: what this rank copied out of the old files

    def read(self, name: str, key: str, start: int, end: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Elements [start, end) of parameter ``name`` (flattened), as (position from start, piece) per old file."""
        saved = self.params[name]
        flats = [rank[key][saved.group] for rank in self.partitions]
        starts = [0]
        for flat in flats[:-1]:
            starts.append(starts[-1] + flat.numel())  # padding only ever trails the last rank's partition
        lo, hi = saved.offset + start, saved.offset + end
        for rank in range(bisect.bisect_right(starts, lo) - 1, len(flats)):
            if starts[rank] >= hi:
                break
            first, last = max(lo, starts[rank]), min(hi, starts[rank] + flats[rank].numel())
            if first < last:
                self.elements_read += last - first
                yield first - lo, flats[rank][first - starts[rank] : last - starts[rank]]


def open_old_shards(stage_dir: Path) -> OldShards:
    """Map every old rank's optimizer file and locate the parameters; no partition data is read here."""
    shapes = load_mapped(stage_dir / "mp_rank_00_model_states.pt")["param_shapes"]
    states = [load_mapped(f)["optimizer_state_dict"] for f in shard_files(stage_dir)]
    partitions = [{"fp32": s["single_partition_of_fp32_groups"],
                   **{key: [g[key] for _, g in sorted(s["base_optimizer_state"]["state"].items())]
                      for key in MOMENTS}} for s in states]
    params = {}
    for group, group_shapes in enumerate(shapes):
        offset = 0
        paddings = states[0]["param_alignment_paddings"][group]
        for (name, shape), padding in zip(group_shapes.items(), paddings, strict=True):
            params[name] = SavedParam(group, offset, torch.Size(shape))
            offset += torch.Size(shape).numel() + padding
    base = states[0]["base_optimizer_state"]
    settings = [{k: v for k, v in group.items() if k != "params"} for group in base["param_groups"]]
    return OldShards(partitions, params, base["state"][0]["step"], settings)


@dataclass(frozen=True)
class LiveParam:
    name: str
    offset: int  # in the live flat group
    numel: int


def fill_partition(targets: dict[str, torch.Tensor], live: list[LiveParam], mine: tuple[int, int],
                   old: OldShards) -> list[str]:
    """Copy into ``targets`` (this rank's flat fp32 and moment partitions of one group, covering the flat range
    ``mine``) the saved values of every parameter overlapping it; returns the names the checkpoint lacks."""
    missing = []
    for param in live:
        start, end = max(param.offset, mine[0]), min(param.offset + param.numel, mine[1])
        if start >= end:
            continue  # no part of this parameter lives in this rank's partition
        if param.name not in old.params:
            missing.append(param.name)
            continue
        for key, target in targets.items():
            base = start - mine[0]
            for position, piece in old.read(param.name, key, start - param.offset, end - param.offset):
                target[base + position : base + position + piece.numel()].copy_(piece)
    return missing


def restore_partitions(ds_engine: Any, stage_dir: Path, rank: int, world_size: int) -> list[str]:
    """Write this rank's slices of the saved state into the live ZeRO-1/2 optimizer; returns names it lacked.

    The group settings matter too: the learning rate in effect is the optimizer group's, which the scheduler
    set at its last step; a scheduler restored from its state dict does not set it again until its next step.
    """
    old = open_old_shards(stage_dir)
    zero = ds_engine.optimizer
    base = zero.optimizer
    for group, settings in zip(base.param_groups, old.group_settings, strict=True):
        group.update(settings)
    names = {id(param): name for name, param in ds_engine.module.named_parameters()}
    missing = []
    for index, flat in enumerate(zero.single_partition_of_fp32_groups):
        moments = {key: torch.zeros_like(flat) for key in MOMENTS}
        base.state[flat] = {"step": step_for(base, old.step), **moments}
        size = zero.bit16_groups_flat[index].numel() // world_size
        # The flat group holds its parameters in this (round-robin) order, at these offsets.
        live = [LiveParam(names.get(id(param), "?"), offset, param.numel()) for param, offset in
                zip(zero.round_robin_bit16_groups[index], zero.round_robin_bit16_offsets[index], strict=True)]
        missing += fill_partition({"fp32": flat.data, **moments}, live, (rank * size, (rank + 1) * size), old)
    return missing


def step_for(optimizer: torch.optim.Optimizer, saved: Any) -> Any:
    """The step count in the form this optimizer keeps it (torch's Adam: a float tensor; DeepSpeedCPUAdam, used
    with offload: an int), whichever of the two wrote the checkpoint."""
    count = float(saved)
    return torch.tensor(count, dtype=torch.float32) if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) \
        else int(count)
