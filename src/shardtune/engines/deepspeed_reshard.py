"""Resume a ZeRO-1/2 checkpoint on a different number of processes.

ZeRO-1/2 keep the full module weights in ``mp_rank_00_model_states.pt`` but split the fp32 master weights and
the Adam moments into one flat partition per rank and parameter group. DeepSpeed refuses to load those
partitions on another world size, and its universal conversion (``ds_to_universal``) was seen to assign our
two-group layout's slices to the wrong parameters (weights off by up to 0.6). So the conversion is ours:

1. read every rank's partitions (``torch.load(weights_only=True)`` with only DeepSpeed's three plain record
   classes allowed) and rebuild each parameter's full fp32 weight and moments, following the layout
   ``deepspeed.utils.zero_to_fp32`` reads: per group, the ranks' partitions concatenated, parameters in
   ``param_shapes`` order, each followed by its alignment padding;
2. let DeepSpeed load the module weights and LR scheduler without optimizer state (it then fills the
   fp32 partitions from the module weights), and
3. copy each parameter's slice of the rebuilt tensors into this rank's new partitions, and the saved group
   settings (learning rate). The offsets come from the live optimizer's flat layout
   (``round_robin_bit16_groups`` and ``round_robin_bit16_offsets``, DeepSpeed 0.19): with
   ``round_robin_gradients`` (on in our presets) that order depends on the world size, and DeepSpeed's own
   per-parameter mapping (``param._hp_mapping``, behind ``safe_set_full_optimizer_state``) does not follow it
   when no parameter needs alignment padding - which is also why its universal conversion went wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def load_shard(path: Path) -> dict[str, Any]:
    from shardtune.engines.safe_load import deepspeed_record_classes

    with torch.serialization.safe_globals(deepspeed_record_classes()):
        return torch.load(path, map_location="cpu", weights_only=True)


def shard_files(stage_dir: Path) -> list[Path]:
    files = list(stage_dir.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    return sorted(files, key=lambda f: int(re.search(r"zero_pp_rank_(\d+)_", f.name).group(1)))


@dataclass
class FullState:
    """A ZeRO-1/2 optimizer state independent of the world size."""

    params: dict[str, dict[str, torch.Tensor]]  # name -> full fp32, exp_avg, exp_avg_sq
    step: Any  # Adam's step count, as the optimizer stored it
    group_settings: list[dict[str, Any]]  # each group's lr (as the scheduler left it), betas, eps, weight decay


def full_states(stage_dir: Path) -> FullState:
    """Rebuild every parameter's full fp32 weight and moments from the shards of any number of ranks."""
    shapes = torch.load(stage_dir / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=True)["param_shapes"]
    shards = [load_shard(f)["optimizer_state_dict"] for f in shard_files(stage_dir)]
    found: dict[str, dict[str, torch.Tensor]] = {}
    for group, group_shapes in enumerate(shapes):
        flats = {"fp32": torch.cat([s["single_partition_of_fp32_groups"][group] for s in shards])}
        for key in MOMENTS:
            flats[key] = torch.cat([s["base_optimizer_state"]["state"][group][key] for s in shards])
        paddings = shards[0]["param_alignment_paddings"][group]
        offset = 0
        for (name, shape), padding in zip(group_shapes.items(), paddings, strict=True):
            numel = int(torch.Size(shape).numel())
            found[name] = {key: flat.narrow(0, offset, numel).view(shape).clone() for key, flat in flats.items()}
            offset += numel + padding
    base = shards[0]["base_optimizer_state"]
    settings = [{k: v for k, v in group.items() if k != "params"} for group in base["param_groups"]]
    return FullState(found, base["state"][0]["step"], settings)


def restore_partitions(ds_engine: Any, full: FullState, rank: int, world_size: int) -> list[str]:
    """Write this rank's slices of ``full`` into the live ZeRO-1/2 optimizer; returns names it lacked.

    The group settings matter too: the learning rate in effect is the optimizer group's, which the scheduler
    set at its last step; a scheduler restored from its state dict does not set it again until its next step.
    """
    zero = ds_engine.optimizer
    base = zero.optimizer
    for group, settings in zip(base.param_groups, full.group_settings, strict=True):
        group.update(settings)
    names = {id(param): name for name, param in ds_engine.module.named_parameters()}
    missing = []
    for index, flat in enumerate(zero.single_partition_of_fp32_groups):
        moments = {key: torch.zeros_like(flat) for key in MOMENTS}
        base.state[flat] = {"step": step_for(base, full.step), **moments}
        targets = {"fp32": flat, **moments}
        size = zero.bit16_groups_flat[index].numel() // world_size
        mine = (rank * size, (rank + 1) * size)
        # The flat group holds its parameters in this (round-robin) order, at these offsets.
        for param, offset in zip(zero.round_robin_bit16_groups[index], zero.round_robin_bit16_offsets[index],
                                 strict=True):
            start, end = max(offset, mine[0]), min(offset + param.numel(), mine[1])
            if start >= end:
                continue  # no part of this parameter lives in this rank's partition
            name = names.get(id(param), "?")
            if name not in full.params:
                missing.append(name)
                continue
            for key, tensor in targets.items():
                piece = full.params[name][key].flatten()[start - offset : end - offset]
                tensor.data[start - mine[0] : end - mine[0]].copy_(piece)
    return missing


def step_for(optimizer: torch.optim.Optimizer, saved: Any) -> Any:
    """The step count in the form this optimizer keeps it (torch's Adam: a float tensor; DeepSpeedCPUAdam, used
    with offload: an int), whichever of the two wrote the checkpoint."""
    count = float(saved)
    return torch.tensor(count, dtype=torch.float32) if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) \
        else int(count)
