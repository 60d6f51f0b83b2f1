"""LoRA adapters trained earlier (``adapter_name_or_path``): merged into the base, or trained further.

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


def resumed_lora_config(path: str) -> Any:
    """The adapter's own LoRA settings (rank, alpha, targets), made trainable."""
    from peft import LoraConfig

    try:
        config = LoraConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ModelError(f"adapter_name_or_path: cannot read the LoRA config in {path}: {err}") from None
    config.inference_mode = False
    return config


def load_adapter_weights(model: Any, path: str) -> None:
    """Copy the saved adapter tensors into the (host) LoRA parameters of a peft model; every one must match."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights_file = Path(path) / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise ModelError(f"adapter_name_or_path: {path} has no {ADAPTER_WEIGHTS}")
    # peft annotates the result as a bare "namedtuple"; it is load_state_dict's (missing_keys, unexpected_keys).
    result: Any = set_peft_model_state_dict(model, load_file(str(weights_file)))
    missing = [name for name in result.missing_keys if ".lora_" in name]
    if missing or result.unexpected_keys:
        raise ModelError(f"adapter_name_or_path: {path} does not fit the model (missing {missing[:2]}, "
                         f"unexpected {list(result.unexpected_keys)[:2]})")
    print(f"[shardtune] continuing to train adapter {path}", flush=True)
