"""Check a saved model folder against the model: an empty or partial save must fail loudly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtune.errors import ModelError
from shardtune.model.adapters import is_adapter_tensor


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
    """What save_pretrained should write: the adapter tensors for a peft model, else every tensor of the state dict
    once (tied ones share a tensor; persistent buffers are written too, e.g. DeepSeek-V3's routing bias)."""
    if hasattr(model, "peft_config"):
        named = state_dict.items() if state_dict is not None else model.named_parameters()
        return sum(t.numel() for n, t in named if is_adapter_tensor(n))
    seen: set[int] = set()
    total = 0
    for tensor in (model.state_dict() if state_dict is None else state_dict).values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel()
    return total


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
