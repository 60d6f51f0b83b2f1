"""peft adapters trained earlier (``adapter_name_or_path``, LoRA or OFT): merged into the base, or trained further.

LLaMA-Factory's rule: of several adapters, all but the last are merged into the base weights and the last one
continues training; with ``create_new_adapter`` every one is merged and a new adapter starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune.errors import ModelError

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterPlan:
    """Which earlier adapters are merged into the base and which one (if any) trains on."""

    to_merge: tuple[str, ...] = ()
    to_resume: str | None = None


def plan_adapters(paths: tuple[str, ...], create_new_adapter: bool) -> AdapterPlan:
    if not paths:
        return AdapterPlan()
    if create_new_adapter:
        return AdapterPlan(to_merge=paths)
    return AdapterPlan(to_merge=paths[:-1], to_resume=paths[-1])


def merge_adapters(model: Any, paths: tuple[str, ...]) -> Any:
    """``model`` with each adapter's low-rank update added into its weights, in order."""
    if not paths:
        return model  # importing peft costs seconds on every rank of a run that merges nothing
    from peft import PeftModel

    for path in paths:
        print(f"[shardtune] merging adapter {path} into the base model", flush=True)
        model = PeftModel.from_pretrained(model, path).merge_and_unload()
    return model


def adapter_method(path: str | Path) -> str:
    """The finetuning type that trained the adapter in ``path`` (``lora`` or ``oft``), from its peft_type."""
    import json

    config = json.loads((Path(path) / "adapter_config.json").read_text())
    return str(config.get("peft_type", "LORA")).lower()


def resumed_adapter_config(path: str, finetuning_type: str) -> Any:
    """The adapter's own settings (LoRA's rank, alpha and targets; OFT's block size), made trainable; an adapter of
    another method than ``finetuning_type`` is refused by name."""
    from peft import PeftConfig

    try:
        config = PeftConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ModelError(f"adapter_name_or_path: cannot read the adapter config in {path}: {err}") from None
    saved = str(config.peft_type.value if hasattr(config.peft_type, "value") else config.peft_type).lower()
    if saved != finetuning_type:
        raise ModelError(f"adapter_name_or_path: {path} holds a {saved} adapter, but finetuning_type is "
                         f"{finetuning_type}; train it on with finetuning_type: {saved}, or set create_new_adapter: "
                         "true to merge it and start a new one")
    config.inference_mode = False
    return config


def load_adapter_weights(model: Any, path: str) -> None:
    """Copy the saved adapter tensors into the (host) adapter parameters of a peft model; every one must match."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights_file = Path(path) / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise ModelError(f"adapter_name_or_path: {path} has no {ADAPTER_WEIGHTS}")
    # peft annotates the result as a bare "namedtuple"; it is load_state_dict's (missing_keys, unexpected_keys).
    result: Any = set_peft_model_state_dict(model, load_file(str(weights_file)))
    missing = [name for name in result.missing_keys if ".lora_" in name or ".oft_" in name]
    if missing or result.unexpected_keys:
        raise ModelError(f"adapter_name_or_path: {path} does not fit the model (missing {missing[:2]}, "
                         f"unexpected {list(result.unexpected_keys)[:2]})")
    print(f"[shardtune] continuing to train adapter {path}", flush=True)
