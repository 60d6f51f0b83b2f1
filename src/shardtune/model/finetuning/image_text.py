"""An image-text model's frozen parts (LLaMA-Factory's freeze_* keys): whatever the method chose, the parts
``FrozenParts`` names stay frozen, and an adapter leaves their Linear layers alone. The parts themselves are found
from the model (model/composite.py)."""

from __future__ import annotations

from typing import Any

from shardtune.model.composite import model_parts
from shardtune.model.finetuning.settings import FrozenParts


def freeze_parts(model: Any, frozen: FrozenParts) -> list[str]:
    """Stop training the frozen parts (after the fine-tuning method chose its trainable parameters); returns the
    names of the parts frozen, for the run log."""
    parts = model_parts(model)
    if parts is None:
        return []
    for name, param in model.named_parameters():
        if frozen.freezes(parts.part_of(name)):
            param.requires_grad_(False)
    named = (("vision tower", "freeze_vision_tower", frozen.vision_tower),
             ("projector", "freeze_multi_modal_projector", frozen.multi_modal_projector),
             ("language model", "freeze_language_model", frozen.language_model))
    return [f"{part} ({key})" for part, key, on in named if on]


def excluded_modules(model: Any, frozen: FrozenParts) -> list[str]:
    """Full names of the Linear layers of frozen parts, which LoRA leaves alone (peft's ``exclude_modules``)."""
    import torch

    parts = model_parts(model)
    if parts is None:
        return []
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and frozen.freezes(parts.part_of(name))]
