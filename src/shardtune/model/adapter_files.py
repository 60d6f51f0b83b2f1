"""An adapter's files: which tensors a peft adapter save holds and the names peft gives them.

Written from a full state dict (the engines gather one), not through peft's ``save_pretrained`` on the live model,
whose module tree an engine may have rewritten.
"""

from __future__ import annotations

from typing import Any


def is_adapter_tensor(name: str) -> bool:
    """A tensor an adapter save holds: LoRA matrices, DoRA magnitudes, OFT rotations, and the full copies of
    ``additional_target`` modules (peft's ``modules_to_save``)."""
    return ".lora_" in name or ".oft_" in name or ".modules_to_save." in name


def adapter_saved_name(name: str, adapter: str = "default") -> str | None:
    """The name peft's ``save_pretrained`` gives ``name`` in adapter_model.safetensors, or None when not saved."""
    if ".modules_to_save." in name:
        marker = f".modules_to_save.{adapter}."
        return name.replace(marker, ".") if marker in name else None
    magnitude = f".lora_magnitude_vector.{adapter}.weight"  # DoRA: peft saves the vector under its module's name
    if name.endswith(magnitude):
        return name[: -len(magnitude)] + ".lora_magnitude_vector"
    marker = f".{adapter}"
    return name.replace(marker, "") if (".lora_" in name or ".oft_" in name) and f"{marker}." in name else None


def save_lora_adapter(model: Any, state_dict: dict[str, Any], out_dir: Any, adapter: str = "default") -> int:
    """Write a peft adapter (LoRA or OFT) from a full state dict, in peft's layout; returns the number of tensors.

    peft's own ``save_pretrained(state_dict=...)`` matches keys against the live module tree, which FSDP1
    rewrites in place (``_fsdp_wrapped_module``), so it would find nothing and write an empty adapter.
    """
    from pathlib import Path

    from safetensors.torch import save_file

    weights = {}
    for key, value in state_dict.items():
        saved = adapter_saved_name(key, adapter)
        if saved is not None:
            weights[saved] = value.detach().cpu().contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    model.peft_config[adapter].save_pretrained(str(out))
    return len(weights)
