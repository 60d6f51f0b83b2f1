"""Check a saved model folder against the model: an empty or partial save must fail loudly."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from shardtune.errors import ModelError
from shardtune.model.adapter_files import is_adapter_tensor

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


@contextlib.contextmanager
def without_deepspeed_lookup() -> Iterator[None]:
    """Around ``save_pretrained`` of a model no DeepSpeed engine wraps: transformers unwraps the model with
    accelerate's ``extract_model_from_parallel``, which imports DeepSpeed whenever it is installed only to test for
    a ``DeepSpeedEngine``; that import costs 3 s (a busy 2-core machine) on every save of a DDP, FSDP or
    one-process run. Where DeepSpeed is already imported the test is free and nothing changes."""
    try:
        from accelerate.utils import other
    except ImportError:
        yield
        return
    if "deepspeed" in sys.modules or not hasattr(other, "is_deepspeed_available"):
        yield
        return
    lookup = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = lookup


def as_pretrained_model(model: object) -> PreTrainedModel:
    """``model`` typed as the transformers model that writers of Hugging Face folders (config, shards) need."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ModelError(f"{type(model).__name__} is not a transformers PreTrainedModel; it cannot be written as a "
                         "Hugging Face model folder")
    return model


def count_saved_parameters(folder: Path) -> int:
    """Elements in every safetensors file of ``folder``, read from the headers only."""
    return sum(_saved_tensor_sizes(folder).values())


def _saved_tensor_sizes(folder: Path) -> dict[str, int]:
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                count = 1
                for dim in f.get_slice(key).get_shape():
                    count *= dim
                sizes[key] = count
    return sizes


def expected_saved_parameters(model: Any, state_dict: dict[str, Any] | None = None) -> int:
    """What save_pretrained should write: the adapter tensors of a peft model, else every parameter (a tied one
    once) and persistent buffer. Under ZeRO-3 a parameter's full size is its ``ds_numel``."""
    if state_dict is not None:
        if hasattr(model, "peft_config"):
            return sum(t.numel() for n, t in state_dict.items() if is_adapter_tensor(n))
        seen: set[int] = set()
        total = 0
        for tensor in state_dict.values():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel()
        return total
    named = list(model.named_parameters())  # shared tensors appear once
    if hasattr(model, "peft_config"):
        return sum(_full_numel(t) for n, t in named if is_adapter_tensor(n))
    buffers = sum(b.numel() for module in model.modules() for name, b in module.named_buffers(recurse=False)
                  if name not in module._non_persistent_buffers_set)
    return sum(_full_numel(t) for _, t in named) + buffers


def _full_numel(tensor: Any) -> int:
    return int(getattr(tensor, "ds_numel", tensor.numel()))  # ZeRO-3 keeps the full size in ds_numel


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


def saved_weights_problem(folder: Path, expected: int) -> str | None:
    """None when the safetensors files in ``folder`` hold ``expected`` elements and no empty tensor; else why not.
    The one check of a complete save, for every engine and for export."""
    sizes = _saved_tensor_sizes(folder)
    if not sizes:
        return f"save_model wrote no .safetensors file to {folder}"
    saved, empty = sum(sizes.values()), [key for key, count in sizes.items() if count == 0]
    if saved == expected and not empty:
        return None
    return (f"saved model in {folder} has {saved:,} parameters but the model has {expected:,} (an empty or partial "
            "save)" + (f"; empty tensors: {empty[:3]}" if empty else ""))


def verify_saved(folder: Path, expected: int) -> None:
    problem = saved_weights_problem(folder, expected)
    if problem:
        raise ModelError(f"{problem}; the training state is still in the latest checkpoint")
