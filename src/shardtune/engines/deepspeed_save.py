"""The final model of a ZeRO-3 run without one consolidated state dict: written as it is gathered.

With ``stage3_gather_16bit_weights_on_model_save: false`` DeepSpeed itself would save no weights at all
(``save_16bit_model`` skips them). shardtune still writes a complete Hugging Face folder, but never holds the
whole model: the parameters of one module at a time are gathered from their ZeRO-3 partitions (a collective
every rank joins), rank 0 copies them to host memory and appends them to the current safetensors shard, and a
shard is written out once it reaches ``max_shard_bytes``. Rank 0's host memory holds at most one shard plus one
module. The tensors keep the dtype DeepSpeed trains the module in (16-bit with bf16/fp16, else fp32).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel

STREAMED_SHARD_BYTES = 5 * 2**30  # Hugging Face's former default shard size
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsShardWriter:
    """Appends tensors to ``model-XXXXX-of-YYYYY.safetensors`` shards (one ``model.safetensors`` when it all fits)."""

    def __init__(self, out_dir: Path, max_shard_bytes: int) -> None:
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []  # temporary file, names in it
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.out_dir / f"model-{len(self.written) + 1:05d}.safetensors.part"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Name the shards (their count is known only now) and write the index; returns the shard files."""
        if self.pending or not self.written:
            self._flush()
        if len(self.written) == 1:
            final = [self.written[0][0].rename(self.out_dir / "model.safetensors")]
            return final
        count, final, weight_map = len(self.written), [], {}
        for number, (path, names) in enumerate(self.written, start=1):
            final.append(path.rename(self.out_dir / f"model-{number:05d}-of-{count:05d}.safetensors"))
            weight_map.update(dict.fromkeys(names, final[-1].name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return final


def saved_parameter_names(model: PreTrainedModel) -> set[str]:
    """Parameter names a Hugging Face save keeps: of tied parameters, the one the model expects on reload."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # One small stand-in per distinct parameter: transformers' own rule then picks the names, no data needed.
    stand_ins: dict[int, torch.Tensor] = {}
    names = {name: stand_ins.setdefault(id(param), torch.empty(1))
             for name, param in model.named_parameters(remove_duplicate=False)}
    return set(remove_tied_weights_from_state_dict(names, model))


def module_state(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A module's own parameters and persistent buffers, copied to host memory (the caller may free the originals)."""
    state = {f"{prefix}{name}": p.detach().to("cpu", copy=True) for name, p in module.named_parameters(recurse=False)}
    for name, buffer in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            state[f"{prefix}{name}"] = buffer.detach().to("cpu", copy=True)
    return state


def plain_module_states(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """One module at a time from an ordinary (unpartitioned) model."""
    for name, module in model.named_modules():
        yield module_state(module, f"{name}." if name else "")


def zero3_module_states(model: torch.nn.Module, is_main: bool) -> Iterator[dict[str, torch.Tensor]]:
    """One module at a time, gathered from its ZeRO-3 partitions; every rank must drain this (empty off rank 0)."""
    import deepspeed

    for name, module in model.named_modules():
        with deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=None):
            state = module_state(module, f"{name}." if name else "") if is_main else {}
        yield state  # after the gathered copies are released


def write_model_streamed(model: PreTrainedModel, states: Iterable[dict[str, torch.Tensor]], out_dir: Path,
                         max_shard_bytes: int = STREAMED_SHARD_BYTES) -> list[Path]:
    """Config, generation config and safetensors shards, as ``save_pretrained`` lays them out (rank 0 only)."""
    from transformers.core_model_loading import revert_weight_conversion

    out_dir.mkdir(parents=True, exist_ok=True)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    kept = saved_parameter_names(model)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    writer = SafetensorsShardWriter(out_dir, max_shard_bytes)
    for state in states:
        state = {k: v for k, v in state.items() if (k in kept or k not in params) and k not in ignored}
        # Checkpoint key names and layouts (e.g. per-expert MoE weights) as the model was loaded; a module's
        # conversions only involve its own tensors.
        for name, tensor in revert_weight_conversion(model, state).items():
            writer.add(name, tensor)
    files = writer.finish()
    save_model_config(model, out_dir)
    return files


def save_model_config(model: PreTrainedModel, out_dir: Path) -> None:
    """What ``save_pretrained`` writes beside the weights."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(out_dir)
