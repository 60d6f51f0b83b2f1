"""Linear layers LoRA must not adapt, found per model with the reason: ``lora_target: all`` leaves them out (and says
so), an explicit target naming one is refused before the adapter is built."""

from __future__ import annotations

from typing import Any

from shardtune.config.adapter_method import METHOD_OF_TARGET_KEY
from shardtune.errors import ConfigError

# Linear layers whose weight the model reads itself while training instead of calling the layer, so an adapter
# around the layer would never be used (and DDP would wait for its gradient): class of the owner -> child -> why.
WEIGHT_READ_IN_TRAINING: dict[str, dict[str, str]] = {
    "Gemma3nTextAltUp": {"correction_coefs": "Gemma 3n's AltUp reads its weight directly while training (clipped "
                                             "to altup_coef_clip), never calling the layer"},
}


def unadaptable_linears(model: Any, linear: list[str]) -> dict[str, str]:
    """Short names of Linear layers LoRA cannot adapt, with the reason: a Linear subclass whose weight is not one
    in -> out map (a modelling file's subclass with its own forward and state: DeepSeek-V4's grouped output
    projection, whose input is wider than its weight, so LoRA's matrices would not fit it; Falcon's plain
    re-implementation is adaptable, quantized Linear layers are peft's to wrap), and the modules
    peft itself refuses for the model type (Mamba's out_proj and conv1d, by peft's own check)."""
    found = {name.rsplit(".", 1)[-1]: f"{type(module).__name__} is a grouped Linear with its own forward"
             for name, module in model.named_modules() if _reshapes_its_weight(module) and "lm_head" not in name}
    for module in model.modules():
        for child, reason in WEIGHT_READ_IN_TRAINING.get(type(module).__name__, {}).items():
            if hasattr(module, child):
                found[child] = reason
    for name in linear:
        refusal = _peft_refusal(model, name)
        if refusal and name not in found:
            found[name] = refusal
    return found


def _reshapes_its_weight(module: Any) -> bool:
    import torch

    if not isinstance(module, torch.nn.Linear) or type(module).forward is torch.nn.Linear.forward:
        return False
    if not type(module).__module__.startswith("transformers.models."):
        return False  # a quantized Linear (bitsandbytes' Linear4bit) is peft's to wrap; only a model's own layers
    own_state = {key for key in vars(module) if not key.startswith("_")} - {"training", "in_features", "out_features"}
    return bool(own_state)


def _peft_refusal(model: Any, name: str) -> str | None:
    try:
        from peft import LoraConfig
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
    except ImportError:  # another peft release: its own check then speaks when the adapter is built
        return None
    try:
        _check_lora_target_modules_mamba(LoraConfig(target_modules=[name]), model, name)
    except ValueError:
        return f"peft refuses it for {getattr(model.config, 'model_type', 'this model')}"
    return None


def refuse_unadaptable_targets(requested: tuple[str, ...], unadaptable: dict[str, str], key: str) -> None:
    for target in requested:
        if target in unadaptable:
            raise ConfigError(f"{key} ({target}): {METHOD_OF_TARGET_KEY[key]} cannot adapt it: "
                              f"{unadaptable[target]}; remove it ({key}: all leaves it out)")
