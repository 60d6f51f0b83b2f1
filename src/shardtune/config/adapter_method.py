"""Which finetuning types train a peft adapter, and which key names that adapter's target modules.

LoRA and OFT share the plumbing around the adapter (a folder saved with ``save_pretrained``'s layout, merged by
``shardtune export``, resumed from ``adapter_name_or_path``, the reference of dpo/kto with the adapter off); only
the adapter's own settings differ (model/finetuning/lora.py for LoRA, model/finetuning/oft.py for OFT).
"""

from __future__ import annotations

from typing import Any

ADAPTER_TYPES = ("lora", "oft")
TARGET_KEYS = {"lora": "lora_target", "oft": "oft_target"}
METHOD_OF_TARGET_KEY = {"lora_target": "LoRA", "oft_target": "OFT"}  # for messages


def is_adapter_type(finetuning_type: str | None) -> bool:
    """True for the finetuning types that train a peft adapter over frozen base weights."""
    return finetuning_type in ADAPTER_TYPES


def target_key(finetuning_type: str) -> str:
    """The key naming the modules the adapter wraps (``lora_target`` for a type that has none of its own)."""
    return TARGET_KEYS.get(finetuning_type, "lora_target")


def adapter_targets(c: Any) -> tuple[str, list[str]]:
    """(key, value) of the run's adapter targets: ``oft_target`` under OFT, else ``lora_target``."""
    key = target_key(c.finetuning_type)
    return key, list(getattr(c, key))
