"""The fine-tuning setup's entry: which parameters of a built model train, read top to bottom.

1. Gradient checkpointing, with our arguments (before peft, which would enable it again with its own).
2. What trains: the method of ``finetuning_type`` (``METHODS``: full.py, freeze.py, or adapter.py for LoRA and
   OFT, where the targets are chosen and refused: targets.py, exclusions.py).
3. What stays frozen whatever the method: an image-text model's parts (image_text.py).
4. NEFTune, on the embedding the model really calls (after peft).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardtune.model.finetuning.adapter import apply_adapter
from shardtune.model.finetuning.freeze import apply_freeze_tuning
from shardtune.model.finetuning.full import apply_frozen, apply_full
from shardtune.model.finetuning.image_text import freeze_parts
from shardtune.model.finetuning.neftune import apply_neftune
from shardtune.model.finetuning.settings import FinetuningSettings, checkpointing_kwargs

# finetuning_type -> the method; "frozen" is no key's value: a preference run's reference model, never trained.
METHODS: dict[str, Callable[[Any, FinetuningSettings], Any]] = {
    "full": apply_full,
    "frozen": apply_frozen,
    "freeze": apply_freeze_tuning,
    "lora": apply_adapter,
    "oft": apply_adapter,
}


def apply_finetuning(model: Any, settings: FinetuningSettings) -> Any:
    """Mark trainable parameters; for LoRA and OFT, return the peft-wrapped model."""
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(settings))
        model.config.use_cache = False
    model = METHODS[settings.finetuning_type](model, settings)
    frozen = freeze_parts(model, settings.frozen_parts)
    if frozen:
        print(f"[shardtune] image-text model: not trained: {', '.join(frozen)}", flush=True)
    if settings.neftune_noise_alpha is not None:
        apply_neftune(model, settings.neftune_noise_alpha, settings.sequence_parallel)
    return model


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts; a ZeRO-3 partitioned parameter (an empty placeholder on every rank)
    counts its full size, ``ds_numel``."""
    trainable = total = 0
    for param in model.parameters():
        n = int(getattr(param, "ds_numel", param.numel()))
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total
