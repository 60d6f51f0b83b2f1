"""Packing whole sft samples into rows of at most ``cutoff_len`` tokens.

Samples are grouped by best-fit decreasing (longest first, each into the fullest row that still
has room), which wastes few slots with the usual mix of short and long samples. A packed row keeps
the boundaries: ``position_ids`` restart at 0 for each sample and ``segment_ids`` number the
samples 1, 2, ... within the row; ``DataCollator`` turns them into an attention mask that stops
samples from seeing each other. The first label of every sample is ``IGNORE_INDEX`` because the
model's shifted loss would otherwise train the previous sample's last token to predict it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from datasets import Dataset, Features, List, Value

from shardtune.data.settings import IGNORE_INDEX

PACKED_FEATURES = Features({
    "input_ids": List(Value("int32")),
    "labels": List(Value("int32")),
    "position_ids": List(Value("int32")),
    "segment_ids": List(Value("int32")),
})


def plan_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group sample indices into rows whose lengths sum to at most ``capacity`` (best-fit decreasing).

    Runs in O(n log n) apart from list inserts; a sample longer than ``capacity`` is a caller bug.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free slots, row index), sorted, for rows that still have room
    for index in order:
        length = lengths[index]
        assert 0 < length <= capacity, f"sample {index} has length {length} outside 1..{capacity}"
        slot = bisect.bisect_left(free, (length, -1))
        if slot < len(free):
            room, row = free.pop(slot)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        if room - length > 0:
            bisect.insort(free, (room - length, row))
    return rows


def pack_dataset(dataset: Dataset, cutoff_len: int) -> Dataset:
    """Pack a tokenised sft dataset (input_ids, labels) into rows with position and segment ids.

    The token lists are read into memory once; that is fine at fine-tuning scale (a million
    1k-token samples would not be, and should be packed offline).
    """
    input_ids: list[list[int]] = list(dataset["input_ids"])
    labels: list[list[int]] = list(dataset["labels"])
    columns: dict[str, list[list[int]]] = {name: [] for name in PACKED_FEATURES}
    for row in plan_rows([len(ids) for ids in input_ids], cutoff_len):
        packed = pack_row([input_ids[i] for i in row], [labels[i] for i in row])
        for name, values in packed.items():
            columns[name].append(values)
    return Dataset.from_dict(columns, features=PACKED_FEATURES)


def pack_row(samples: Sequence[list[int]], sample_labels: Sequence[list[int]]) -> dict[str, list[int]]:
    """Concatenate samples into one row with restarting positions and 1-based segment ids."""
    row: dict[str, list[int]] = {name: [] for name in PACKED_FEATURES}
    for segment, (ids, labels) in enumerate(zip(samples, sample_labels, strict=True), start=1):
        row["input_ids"] += ids
        row["labels"] += [IGNORE_INDEX] + list(labels[1:])
        row["position_ids"] += range(len(ids))
        row["segment_ids"] += [segment] * len(ids)
    return row
