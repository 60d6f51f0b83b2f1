"""Check a saved model folder against the model: an empty or partial save must fail loudly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtune.errors import ModelError


def count_saved_parameters(folder: Path) -> int:
    """Elements in every safetensors file of ``folder``, read from the headers only."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                count = 1
                for dim in f.get_slice(key).get_shape():
                    count *= dim
                total += count
    return total


def expected_saved_parameters(model: Any, state_dict: dict[str, Any] | None = None) -> int:
    """What save_pretrained should write: the LoRA tensors for a peft model, else every (untied) parameter."""
    if state_dict is not None:
        named = state_dict.items()
    else:
        named = ((n, p) for n, p in model.named_parameters())  # shared tensors appear once
    if hasattr(model, "peft_config"):
        return sum(t.numel() for n, t in named if ".lora_" in n or ".modules_to_save." in n)
    if state_dict is not None:
        seen: set[int] = set()
        total = 0
        for tensor in state_dict.values():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel()
        return total
    return sum(t.numel() for _, t in named)


def verify_saved(folder: Path, expected: int) -> None:
    saved = count_saved_parameters(folder)
    if saved != expected or saved == 0:
        raise ModelError(f"saved model in {folder} has {saved:,} parameters but the model has {expected:,} "
                         "(an empty or partial save); the training state is still in the latest checkpoint")
