"""The replicated engines' record: one process (``local``) and DDP, which keep whole weights on every rank.

Import-light: the engines themselves are engines/local.py and engines/ddp.py (on engines/torch_native.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtune.engines.spec import (
    CheckpointLayout,
    EngineSpec,
    MemoryLayout,
    compile_problems,
    float8_problems,
    one_process_optimizer_problems,
)

if TYPE_CHECKING:
    import torch

    from shardtune.config.schema import TrainConfig
    from shardtune.engines.engine_plan import EnginePlan

WEIGHTS_FILE = "trainable.safetensors"  # a checkpoint's trained weights (all of them, or the adapter's)


def read_trainable(model: torch.nn.Module, folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / WEIGHTS_FILE))


def _no_refusals(c: TrainConfig, plan: EnginePlan, has_cuda: bool) -> list[str]:
    # Whole weights on every rank: every finetuning method and optimizer works.
    return compile_problems(c, plan.kind) + float8_problems(c, plan.kind)


CHECKPOINTS = (CheckpointLayout("torch", WEIGHTS_FILE, read_trainable),)
LOCAL = EngineSpec(
    kind="local",
    describe=lambda plan: "local (single process)",
    resolved_settings=lambda plan, config, layout: None,
    refusals=_no_refusals,
    memory_layout=lambda plan: MemoryLayout("DDP", "replicated"),
    gathers_parameters=lambda plan: False,
    engine="shardtune.engines.ddp:DDPEngine",  # one process under a launcher (FORCE_TORCHRUN): DDP of one rank
    checkpoints=CHECKPOINTS,
)


def _ddp_refusals(c: TrainConfig, plan: EnginePlan, has_cuda: bool) -> list[str]:
    return _no_refusals(c, plan, has_cuda) + one_process_optimizer_problems(c, "ddp")


# The same record, whole weights on every rank, but for what needs one process.
DDP = replace(LOCAL, kind="ddp", describe=lambda plan: "ddp", refusals=_ddp_refusals)
