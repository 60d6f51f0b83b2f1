"""Full fine-tuning: every parameter trains; and ``frozen``: none does (a preference run's reference model)."""

from __future__ import annotations

from typing import Any

from shardtune.model.finetuning.settings import FinetuningSettings


def apply_full(model: Any, settings: FinetuningSettings) -> Any:
    model.requires_grad_(True)
    return model


def apply_frozen(model: Any, settings: FinetuningSettings) -> Any:
    model.requires_grad_(False)
    return model
