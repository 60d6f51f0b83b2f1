"""The prompts stage grpo samples completions for, with the columns its reward functions read.

Records are read as sft reads them (alpaca: the prompt and query columns; sharegpt/openai: the conversation), and
the prompt is every turn before the last answer with the template applied, encoded exactly as training encodes it
(``prediction.encode_prompt_batch``), so the model continues where it learned to answer. The last answer is not
trained on: reward functions get it as ``answer``, beside the record's own columns under their names (a column of
that name wins). Rows are numbered (``index``): the number seeds the row's sampling, so the completions of a prompt do
not depend on the process count or the batch it lands in.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from functools import partial
from typing import Any

from datasets import Dataset, Features, List, Value, concatenate_datasets

from shardtune.data.build import fresh_cache, prepared_template
from shardtune.data.formats import normalize_records
from shardtune.data.loading import load_records
from shardtune.data.registry import resolve_entries
from shardtune.data.settings import DataSettings, dataset_names
from shardtune.data.templates import Template
from shardtune.errors import DataError

RL_PROMPT_FEATURES = Features({"input_ids": List(Value("int32")), "columns": Value("string"), "index": Value("int64"),
                               "_length": Value("int32")})


def build_rl_prompts(tokenizer: Any, settings: DataSettings, max_completion_length: int) -> Dataset:
    """Every record's prompt ids and reward columns; a prompt that leaves fewer than ``max_completion_length`` tokens
    of ``cutoff_len`` is an error naming how many there are and the first one."""
    sft = dataclasses.replace(settings, stage="sft")
    with fresh_cache(settings.overwrite_cache):
        records = load_with_columns(sft)
    encode = partial(encode_rl_prompt_batch, tokenizer=tokenizer, template=prepared_template(tokenizer, sft))
    encoded = records.map(encode, batched=True, remove_columns=records.column_names, features=RL_PROMPT_FEATURES,
                          num_proc=settings.preprocessing_num_workers, batch_size=settings.preprocessing_batch_size,
                          desc="Tokenizing prompts")
    limit = settings.cutoff_len - max_completion_length
    too_long = [i for i, n in enumerate(encoded["_length"]) if n > limit]
    if too_long:
        raise DataError(f"{len(too_long)} of {len(encoded)} prompts are longer than cutoff_len "
                        f"({settings.cutoff_len}) - max_completion_length ({max_completion_length}) = {limit} tokens "
                        f"(the first: record {too_long[0]}, {encoded['_length'][too_long[0]]} tokens); raise "
                        "cutoff_len or shorten them")
    if len(encoded) == 0:
        raise DataError(f"datasets {', '.join(dataset_names(settings))} hold no prompt")
    return encoded.remove_columns("_length")


def load_with_columns(settings: DataSettings) -> Dataset:
    """The named datasets normalised as sft reads them, each record's raw columns kept as JSON (``_columns``)."""
    entries, problems = resolve_entries(dataset_names(settings), settings.dataset_dir)
    parts = []
    for entry in entries:
        try:
            raw = load_records(entry, settings.max_samples, settings.seed)
            columns = [json.dumps(row, default=str) for row in raw]
            chat = normalize_records(raw, entry, "sft", settings.preprocessing_num_workers,
                                     settings.preprocessing_batch_size)
            parts.append(chat.add_column("_columns", columns))
        except DataError as err:
            problems += err.problems
    if problems:
        raise DataError(*problems)
    mixed = concatenate_datasets(parts)
    return mixed.add_column("_index", list(range(len(mixed))))


def encode_rl_prompt_batch(batch: Mapping[str, list[Any]], tokenizer: Any, template: Template) -> dict[str, list]:
    """Batched map function: the turns before the last answer as training encodes them, and the reward columns."""
    tools = batch.get("tools") or [""] * len(batch["_messages"])
    out: dict[str, list[Any]] = {"input_ids": [], "columns": [], "index": [], "_length": []}
    for system, messages, sample_tools, raw, index in zip(batch["_system"], batch["_messages"], tools,
                                                          batch["_columns"], batch["_index"], strict=True):
        turns = template.render_turns(system, messages, tokenizer, sample_tools or "")
        pieces = [piece for turn in turns[:-1] for piece in turn] + [turns[-1][0]]
        ids = [token for piece in tokenizer(pieces, add_special_tokens=False)["input_ids"] for token in piece]
        out["input_ids"].append(ids)
        out["columns"].append(json.dumps({"answer": messages[-1]["content"], **json.loads(raw)}))
        out["index"].append(index)
        out["_length"].append(len(ids))
    return out


class RolloutPromptCollator:
    """A micro-batch of prompts as lists (each group is generated on its own, so nothing is padded here)."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return {"prompt_ids": [list(f["input_ids"]) for f in features],
                "columns": [json.loads(f["columns"]) for f in features],
                "index": [int(f["index"]) for f in features]}
