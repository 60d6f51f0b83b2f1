"""Token-budget micro-batches (``micro_batch_tokens``): as many samples per micro-batch as fit in a token budget.

LLaMA-Factory v1's ``dynamic_batching`` / ``dynamic_padding_free`` (its ``plugins/trainer_plugins/batching.py``)
fill each micro-batch greedily in the sampler's order: padded rows count the longest sample times the samples,
padding-free rows the sum of their lengths. Every rank must still run the same number of micro-batches per
optimizer step, or the engines' collectives hang, so the batches are built for the whole job, not per rank:

* formed once per run, from the sampler's order for the seed (a shuffle, or group_by_length's order), so every
  epoch has the same number of steps (fairseq's ``batch_by_size`` does the same);
* each epoch puts them in a new order (the heaviest first, so a run that does not fit fails at its first step),
  cuts that order into steps of ``ranks x gradient_accumulation_steps`` micro-batches and deals each step out, rank
  r taking the step's r-th, (r + ranks)-th, ... micro-batch;
* a last step whose micro-batches do not divide by the ranks has its fullest ones halved until they do (halves
  keep the budget and the step keeps its samples, so the loss is the one of a single process); only a step of
  single samples too few for the ranks repeats the epoch's smallest micro-batches, as ``DistributedSampler``
  repeats samples (that step then differs from a single process's).

The step's loss is then normalised by the trainable tokens of the whole step on all ranks (train/loop.py), as
v1 does, so a step's update does not depend on how its samples fell into micro-batches or onto ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


def budget_cost(lengths: Sequence[int], padded: bool) -> int:
    """Tokens a micro-batch of samples of these lengths takes: padded rows' slots, or the tokens themselves."""
    if not lengths:
        return 0
    return max(lengths) * len(lengths) if padded else sum(lengths)


def form_budget_batches(order: Sequence[int], lengths: Sequence[int], budget: int, padded: bool) -> list[list[int]]:
    """Cut ``order`` into runs of samples whose ``budget_cost`` stays within ``budget``, greedily, in order.

    A sample longer than the budget takes a micro-batch alone (validation keeps ``budget >= cutoff_len``).
    """
    batches: list[list[int]] = []
    current: list[int] = []
    longest = total = 0  # of ``current``, kept as it grows: one pass over the data
    for index in order:
        size = lengths[index]
        cost = max(longest, size) * (len(current) + 1) if padded else total + size
        if current and cost > budget:
            batches.append(current)
            current, longest, total = [], 0, 0
        current.append(index)
        longest, total = max(longest, size), total + size
    if current:
        batches.append(current)
    return batches


def epoch_order(batches: Sequence[Sequence[int]], lengths: Sequence[int], padded: bool, seed: int,
                epoch: int) -> list[int]:
    """The batches' order in ``epoch``: a shuffle for the seed and epoch, the heaviest batch moved to the front."""
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    if order:
        heaviest = max(order, key=lambda b: budget_cost([lengths[i] for i in batches[b]], padded))
        order.remove(heaviest)
        order.insert(0, heaviest)
    return order


def steps_of(batches: Sequence[list[int]], per_step: int) -> list[list[list[int]]]:
    return [list(batches[start:start + per_step]) for start in range(0, len(batches), per_step)]


def even_last_step(step: list[list[int]], ranks: int, spare: Sequence[list[int]]) -> list[list[int]]:
    """``step`` with a number of micro-batches that divides by ``ranks``: its fullest micro-batches halved, or,
    when it holds too few samples for that, micro-batches from ``spare`` repeated."""
    step = list(step)
    while len(step) % ranks:
        fullest = max(range(len(step)), key=lambda b: len(step[b]))
        if len(step[fullest]) < 2:
            break
        half = len(step[fullest]) // 2
        step[fullest:fullest + 1] = [step[fullest][:half], step[fullest][half:]]
    borrowed = itertools.cycle(spare)
    while len(step) % ranks:
        step.append(list(next(borrowed)))
    return step


def deal_budget_batches(batches: Sequence[list[int]], order: Sequence[int], ranks: int, rank: int,
                        accumulation: int) -> list[list[int]]:
    """This rank's micro-batches of one epoch: ``batches`` in ``order``, cut into steps of ``ranks x
    accumulation`` micro-batches, each step dealt out round-robin. Every rank gets the same number per step."""
    ordered = [batches[b] for b in order]
    steps = steps_of(ordered, ranks * accumulation)
    if steps:  # the fewest samples are repeated, when it comes to that
        spare = sorted(ordered, key=len)
        steps[-1] = even_last_step(steps[-1], ranks, spare)
    return [batch for step in steps for batch in step[rank::ranks]]


class TokenBudgetBatches(Sampler[list[int]]):
    """A batch sampler of this rank's token-budget micro-batches (see the module docstring); ``set_epoch`` reorders
    them and ``start`` skips that many of this rank's micro-batches (a run resumed mid-epoch)."""

    def __init__(self, batches: list[list[int]], lengths: Sequence[int], padded: bool, *, ranks: int, rank: int,
                 accumulation: int, seed: int) -> None:
        super().__init__()
        self.batches = batches
        self.lengths = list(lengths)
        self.padded = padded
        self.ranks, self.rank, self.accumulation, self.seed = ranks, rank, accumulation, seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def epoch_batches(self) -> list[list[int]]:
        order = epoch_order(self.batches, self.lengths, self.padded, self.seed, self.epoch)
        return deal_budget_batches(self.batches, order, self.ranks, self.rank, self.accumulation)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.epoch_batches()[self.start:])

    def __len__(self) -> int:
        # The last step is evened out to a multiple of the ranks, every other step is one already.
        return max(0, -(-len(self.batches) // self.ranks) - self.start)
