"""One rank's slice of a micro-batch under sequence parallelism (the attention side is
engines/sequence_parallel.py). Pure tensor code: no process group.

The collator pads every row to a multiple of the sequence group's size and hands over the row's segment ids
(``segment_ids``: 1.. per sample, 0 for padding). Slice ``index`` of ``size`` keeps its tokens and global position ids,
the labels shifted over the *whole* row (``shift_labels``: the slice's last token is scored on the next slice's first
token, which a shift after slicing would lose), and the whole row's segments as [start, end) spans
(``segment_spans``), which decide what each query attends to. The spans are found here, on the host, once per
micro-batch: the attention of every layer reads them without a device-to-host copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch

from shardtune.train.loss import next_token_targets

Spans = list[list[tuple[int, int]]]  # per row, [start, end) of each segment, in global token indices

# What a split micro-batch no longer carries: masks and varlen offsets describe whole rows.
WHOLE_ROW_KEYS = ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "labels",
                  "segment_ids")


def sequence_shard(batch: dict, size: int, index: int) -> dict:
    """Slice ``index`` (of ``size``) of every row of ``batch``; other keys (counts, tags) are kept."""
    ids = batch["input_ids"]
    length = ids.shape[1]
    if length % size:
        raise ValueError(f"sequence parallelism: rows of {length} tokens do not split into {size} slices (the "
                         "collator pads rows to a multiple of sequence_parallel_size)")
    per = length // size
    part = slice(index * per, (index + 1) * per)
    segments = batch["segment_ids"]
    shard = {key: value for key, value in batch.items() if key not in WHOLE_ROW_KEYS}
    shard.update(input_ids=ids[:, part], position_ids=batch["position_ids"][:, part],
                 shift_labels=next_token_targets(batch["labels"])[:, part],
                 segment_spans=[segment_spans(row) for row in segments], num_tokens=(segments[:, part] > 0).sum())
    return shard


def segment_spans(segments: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal segment ids in one row."""
    counts = torch.unique_consecutive(segments, return_counts=True)[1].tolist()
    ends = list(itertools.accumulate(counts))
    return list(zip([0, *ends[:-1]], ends, strict=True))


def spans_of(batch: Mapping[str, Any], start: int = 0, stop: int | None = None) -> Spans:
    """The segment spans of rows [start, stop) of a split micro-batch (``sequence_shard``'s ``segment_spans``)."""
    spans: Spans = batch["segment_spans"]
    return spans[start:stop]
