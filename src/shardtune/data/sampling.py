"""Length grouping (``group_by_length``): batches of similar-length samples, so padding stays low.

The order is built for the whole job and then dealt out like ``DistributedSampler`` does (rank r takes
every world-size-th index), so a global batch - the same micro-batch index on every rank - is a run of
neighbouring indices in the grouped order: similar lengths on all ranks, not just within one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler

# Samples are sorted within windows of this many global batches: wide enough to find similar
# lengths, narrow enough that the data order stays random (the Hugging Face Trainer uses 50 too).
MEGABATCH_BATCHES = 50


def length_grouped_order(lengths: Sequence[int], global_batch: int, seed: int,
                         megabatch_batches: int = MEGABATCH_BATCHES) -> list[int]:
    """A random permutation in which each run of ``global_batch`` indices has similar lengths.

    Shuffle, sort each megabatch by length, cut it into global batches, then shuffle the batches (so
    step number and length are unrelated), except that the batch holding the longest sample goes
    first: a run that does not fit in memory fails at its first step, not hours in.
    """
    generator = torch.Generator().manual_seed(seed)
    permutation = torch.randperm(len(lengths), generator=generator).tolist()
    size = global_batch * megabatch_batches
    batches: list[list[int]] = []
    for start in range(0, len(permutation), size):
        megabatch = sorted(permutation[start : start + size], key=lambda i: -lengths[i])
        batches += [megabatch[i : i + global_batch] for i in range(0, len(megabatch), global_batch)]
    if not batches:
        return []
    order = torch.randperm(len(batches), generator=generator).tolist()
    longest = max(range(len(batches)), key=lambda b: lengths[batches[b][0]])
    order.remove(longest)
    return [index for b in [longest, *order] for index in batches[b]]


class LengthGroupedSampler(DistributedSampler):
    """``DistributedSampler`` (same length, padding and ``set_epoch``) with a length-grouped order."""

    def __init__(self, lengths: Sequence[int], batch_size: int, num_replicas: int, rank: int, seed: int) -> None:
        # DistributedSampler only takes len() of its dataset; torch annotates it as Dataset.
        super().__init__(range(len(lengths)), num_replicas=num_replicas, rank=rank,  # type: ignore[arg-type]
                         shuffle=True, seed=seed, drop_last=False)
        self.lengths = list(lengths)
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[int]:
        order = length_grouped_order(self.lengths, self.batch_size * self.num_replicas, self.seed + self.epoch)
        while len(order) < self.total_size:  # as DistributedSampler: repeat samples to divide evenly
            order += order[: self.total_size - len(order)]
        return iter(order[self.rank : self.total_size : self.num_replicas])
