"""LLaMA-Pro block expansion (`shardtune expand-model`): a copy of every ``layers / N``-th decoder layer inserted
after it, its output projections zeroed, so the expanded model computes exactly what the original did until the
new blocks train (``use_llama_pro: true`` with ``freeze_trainable_layers: N`` trains only them).

The rule is LLaMA-Factory's (scripts/llama_pro.py: the same positions, ``o_proj`` and ``down_proj`` zeroed); the
folder is written through transformers (its own config class, safetensors), so every loading path reads it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from shardtune.errors import ConfigError

# The projections that write a block's result into the residual stream: zero, the block adds nothing.
OUTPUT_PROJECTIONS = ("o_proj", "down_proj")
LAYER_KEY = re.compile(r"^(?P<head>.*\.layers\.)(?P<index>\d+)(?P<tail>\..*)$")
# Per-layer lists of a config (one entry per decoder layer): an inserted block repeats its source's entry.
PER_LAYER_LISTS = ("layer_types",)
# Written for the expanded model by save_pretrained; every other file of the source folder is copied.
WRITTEN_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "config.json")


def expansion_sources(num_layers: int, num_expand: int) -> list[int]:
    """For each layer of the expanded model, the original layer it copies (an inserted block repeats the layer
    before it); ``num_expand`` must divide ``num_layers``."""
    if num_expand <= 0 or num_layers % num_expand:
        raise ConfigError(f"expand-model: --num-expand ({num_expand}) must divide the model's {num_layers} layers")
    split = num_layers // num_expand
    sources = []
    for index in range(num_layers):
        sources.append(index)
        if (index + 1) % split == 0:
            sources.append(index)
    return sources


def expanded_state(state: dict[str, Any], sources: list[int]) -> dict[str, Any]:
    """The expanded model's tensors: layer ``new`` holds layer ``sources[new]``'s, the inserted copies (the second
    of a repeated source) with their output projections zeroed; tensors outside the layers unchanged."""
    by_layer: dict[int, list[tuple[str, str, Any]]] = {}
    expanded: dict[str, Any] = {}
    for key, tensor in state.items():
        match = LAYER_KEY.match(key)
        if match is None:
            expanded[key] = tensor
        else:
            by_layer.setdefault(int(match["index"]), []).append((match["head"], match["tail"], tensor))
    zeroed = 0
    for new, source in enumerate(sources):
        inserted = new > 0 and sources[new - 1] == source
        for head, tail, tensor in by_layer.get(source, []):
            copy = tensor.clone()
            if inserted and any(f".{name}." in tail for name in OUTPUT_PROJECTIONS):
                copy.zero_()
                zeroed += 1
            expanded[f"{head}{new}{tail}"] = copy
    if zeroed == 0:
        raise ConfigError("expand-model: the model's layers have no o_proj / down_proj weights to zero (LLaMA-Pro "
                          "needs a LLaMA-style decoder)")
    return expanded


def expand_model(source: str, out: str, num_expand: int) -> Path:
    """Write ``source`` expanded by ``num_expand`` blocks to ``out`` (tokenizer and other files copied)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    text = config.get_text_config()
    sources = expansion_sources(text.num_hidden_layers, num_expand)
    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    state = expanded_state(model.state_dict(), sources)
    text.num_hidden_layers = len(sources)
    for name in PER_LAYER_LISTS:
        values = getattr(text, name, None)
        if isinstance(values, list) and len(values) == len(set(sources)):
            setattr(text, name, [values[i] for i in sources])
    expanded = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    expanded.load_state_dict(state, strict=True)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    expanded.save_pretrained(target)
    for entry in Path(source).iterdir():
        if entry.is_file() and entry.name not in WRITTEN_FILES and not entry.name.endswith(".safetensors"):
            shutil.copy2(entry, target / entry.name)
    return target
