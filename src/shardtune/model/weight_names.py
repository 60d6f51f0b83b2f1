"""The tensor names a model folder's safetensors files hold, read from their headers (no torch, no weights).

Lets the launching host catch a mistyped module name (``lora_target: q_prj``) before any rank loads the model.
Checkpoint names can differ from module names where transformers converts a checkpoint on load, so a name missing
here is only a typo when a close one is present.
"""

from __future__ import annotations

import difflib
import json
import struct
from pathlib import Path

from shardtune.model.folder import SAFETENSORS_INDEX


def tensor_names(folder: Path) -> list[str] | None:
    """Every tensor name of the folder's safetensors weights; None when it has none or they cannot be read."""
    index = folder / SAFETENSORS_INDEX
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            return list(weight_map) if isinstance(weight_map, dict) else None
        single = folder / "model.safetensors"
        if not single.is_file():
            return None
        with single.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        return [name for name in header if name != "__metadata__"]
    except (OSError, ValueError, struct.error, AttributeError):
        return None


def module_short_names(names: list[str]) -> set[str]:
    """The last part of each weight's module path: ``model.layers.0.self_attn.q_proj.weight`` -> ``q_proj``."""
    return {name.rsplit(".", 2)[-2] for name in names if name.endswith(".weight") and name.count(".") >= 1}


def mistyped_modules(wanted: list[str], folder: Path) -> dict[str, str]:
    """Each name of ``wanted`` that the folder's weights lack while holding a close one: {typed: close}."""
    names = tensor_names(folder)
    if names is None:
        return {}
    present = module_short_names(names)
    found = {}
    for name in wanted:
        close = difflib.get_close_matches(name, sorted(present), n=1, cutoff=0.75)
        if name not in present and close:
            found[name] = close[0]
    return found


def module_names_anywhere(names: list[str]) -> set[str]:
    """Every module name along each weight's path (``model``, ``layers``, ``0``, ``self_attn``, ``q_proj``): what
    peft's ``modules_to_save`` can match, whatever prefix transformers adds or drops on load."""
    return {part for name in names for part in name.split(".")[:-1]}


def absent_modules(wanted: list[str], folder: Path) -> list[str]:
    """The names of ``wanted`` that name no module anywhere in the folder's weights ([] when they cannot be read)."""
    names = tensor_names(folder)
    if names is None:
        return []
    present = module_names_anywhere(names)
    return [name for name in wanted if name not in present]
