"""Check a saved model folder against the model: an empty or partial save must fail loudly."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from shardtune.errors import ModelError
from shardtune.model.adapters import is_adapter_tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class SavesPretrained(Protocol):
    """A Hugging Face model or a peft model: it writes itself in Hugging Face format."""

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> Any: ...


def has_save_pretrained(model: object) -> TypeGuard[SavesPretrained]:
    # hasattr, not a runtime_checkable isinstance: from Python 3.12 that skips __getattr__, through which
    # wrappers (peft, DeepSpeed) forward methods.
    return hasattr(model, "save_pretrained")


def as_saves_pretrained(model: object) -> SavesPretrained:
    """``model`` typed as something with ``save_pretrained``; a module without it cannot be saved in HF format."""
    if not has_save_pretrained(model):
        raise ModelError(f"{type(model).__name__} has no save_pretrained: only Hugging Face (transformers or peft) "
                         "models can be saved")
    return model


def as_pretrained_model(model: object) -> PreTrainedModel:
    """``model`` typed as the transformers model that writers of Hugging Face folders (config, shards) need."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ModelError(f"{type(model).__name__} is not a transformers PreTrainedModel; it cannot be written as a "
                         "Hugging Face model folder")
    return model


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
    """What save_pretrained should write: the adapter tensors for a peft model, else every (untied) parameter."""
    named: Iterable[tuple[str, Any]]
    if state_dict is not None:
        named = state_dict.items()
    else:
        named = ((n, p) for n, p in model.named_parameters())  # shared tensors appear once
    if hasattr(model, "peft_config"):
        return sum(t.numel() for n, t in named if is_adapter_tensor(n))
    if state_dict is not None:
        seen: set[int] = set()
        total = 0
        for tensor in state_dict.values():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel()
        return total
    return sum(t.numel() for _, t in named)


def share_tied_tensors(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Point every tied name of a gathered state dict at one tensor.

    A sharding engine gathers each name on its own, so a tied matrix (``lm_head`` = ``embed_tokens``) arrives as
    two equal copies; ``save_pretrained`` then writes both, and the files hold the matrix twice. Shared again, it is
    written once and the reload ties it. Copies that differ mean training broke the tie: an error, not a choice.
    """
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target not in state or source not in state or state[target] is state[source]:
            continue
        if not state[target].equal(state[source]):
            raise ModelError(f"{target} is tied to {source} in the model but they differ after training; "
                             "the tie was broken by the engine (please report it)")
        state[target] = state[source]
    return state


def verify_saved(folder: Path, expected: int) -> None:
    saved = count_saved_parameters(folder)
    if saved != expected or saved == 0:
        raise ModelError(f"saved model in {folder} has {saved:,} parameters but the model has {expected:,} "
                         "(an empty or partial save); the training state is still in the latest checkpoint")
