"""Models whose token positions index a table of fixed size: learned position embeddings (GPT-2, OPT, BART,
Blenderbot, BERT-style decoders) and sinusoidal tables built once (Pegasus, Marian, RoFormer). A row longer than
the table fails inside the first forward with "index out of range in self" (Blenderbot's 128 positions against
244-token rows, in the registry matrix of 2026-11-27); RoPE and ALiBi models have no table and take longer rows.

Read from transformers' modelling source, not imported (as model/attention.py), so the launching host says it
before any rank starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# The table's size in config.json, under the names the position-table families use.
SIZE_KEYS = ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx")
TABLE = re.compile(r"LearnedPositionalEmbedding\(|class \w*SinusoidalPositionalEmbedding\(nn\.Embedding\)"
                   r"|nn\.Embedding\(\s*(?:config\.)?(?:max_position_embeddings|n_positions|max_positions|n_ctx)\b")


def position_table(config: Mapping[str, Any]) -> tuple[str, int] | None:
    """(config key, size) of the model's position table; None when its positions need none (RoPE, ALiBi, none at
    all) or its class is not known before loading (remote code)."""
    from shardtune.model.attention import causal_lm_class_file

    found = causal_lm_class_file(config)
    if found is None or not TABLE.search(found[1].read_text(encoding="utf-8")):
        return None
    for key in SIZE_KEYS:
        size = config.get(key)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return key, size
    return None


def position_problem(cutoff_len: int, config: Mapping[str, Any], model: str) -> str | None:
    """Why rows of ``cutoff_len`` tokens cannot go through this model's position table (None: they can)."""
    table = position_table(config)
    if table is None or cutoff_len <= table[1]:
        return None
    key, size = table
    return (f"cutoff_len ({cutoff_len}): {model} ({config.get('model_type')}) looks positions up in a table of {size} "
            f"({key} in its config.json), so a longer row fails inside the model; set cutoff_len: {size} or less")
