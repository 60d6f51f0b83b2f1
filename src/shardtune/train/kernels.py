"""The model-changing switches on a rank: fp8 (model/fp8.py), enable_liger_kernel (model/liger.py), and packed rows
through layers with a state (model/packed_state.py: each sample's state starts fresh).

Each rank checks its own device before any weight loads (the launching host may have no GPU while the ranks do),
then patches the model the engine built, before the engine wraps it: Liger's kernels first (they replace norms
and the MLP's activation, not its Linear layers), then the float8 swap of the Linear layers, then (torch_compile)
the regional compile.
"""

from __future__ import annotations

import torch

from shardtune.config.schema import TrainConfig
from shardtune.data.settings import packs_sample_boundaries
from shardtune.model.fp8 import apply_float8_training, check_float8_device, float8_wanted
from shardtune.model.liger import apply_liger_kernels, check_liger_device
from shardtune.train.setup import padding_free_rows


def check_kernel_devices(c: TrainConfig) -> None:
    """Refuse (one line) where this rank's device cannot run what fp8 / enable_liger_kernel ask for."""
    if float8_wanted(c):
        check_float8_device()
    if c.enable_liger_kernel:
        check_liger_device()


def apply_kernels(model: torch.nn.Module, c: TrainConfig, is_main: bool) -> None:
    """Liger's kernels, then float8 Linear layers, on the model the engine built (a meta skeleton under FSDP)."""
    lines = []
    # padding_free_rows: unset, padding_free is on wherever the block mask is free (the CPU), so it counts here too
    if (packs_sample_boundaries(c) or padding_free_rows(c)) and (line := apply_packed_state(model)):
        lines.append(line)
    if c.enable_liger_kernel:
        lines.append(apply_liger_kernels(model).line())
    if float8_wanted(c):
        lines.append(apply_float8_training(model, c.fp8_enable_fsdp_float8_all_gather).line())
    if is_main:
        for line in lines:
            print(line, flush=True)


def apply_packed_state(model: torch.nn.Module) -> str | None:
    """Rows holding several samples: the model's stateful blocks run once per sample (None: it has none)."""
    from shardtune.model.attention import stateful_layer_kinds
    from shardtune.model.packed_state import apply_sample_boundaries

    kinds = stateful_layer_kinds(getattr(model, "config", None) or {})
    if not kinds:
        return None
    wrapped = apply_sample_boundaries(model, kinds).wrapped
    return (f"[shardtune] packing: {len(wrapped)} blocks with a state ({', '.join(kinds)}) run once per packed "
            "sample, each from a fresh state")
