"""``micro_batch_tokens``: token-budget micro-batches formed for the whole job, then dealt out so every rank runs the
same number per step (data/budget_batches.py); the key's checks; LLaMA-Factory v1's dynamic strategies mapped to it."""

from __future__ import annotations

import random

import pytest

from shardtune.config.lf_v1 import V1_PREFIX, translate_v1
from shardtune.config.load import build_config
from shardtune.data.budget_batches import (
    TokenBudgetBatches,
    budget_cost,
    deal_budget_batches,
    epoch_order,
    form_budget_batches,
)
from shardtune.data.collator import DataCollator
from shardtune.launch.validate import cross_key_problems
from shardtune.train.setup import build_loader, epoch_batches_for


def random_lengths(count: int, seed: int = 0, longest: int = 64) -> list[int]:
    draw = random.Random(seed)
    return [draw.randint(1, longest) for _ in range(count)]


def rank_batches(lengths: list[int], budget: int, padded: bool, ranks: int, accumulation: int, epoch: int = 0,
                 seed: int = 7) -> list[list[list[int]]]:
    batches = form_budget_batches(list(range(len(lengths))), lengths, budget, padded)
    order = epoch_order(batches, lengths, padded, seed, epoch)
    return [deal_budget_batches(batches, order, ranks, rank, accumulation) for rank in range(ranks)]


def test_greedy_batches_fill_the_budget_in_order_as_llamafactory_v1_does():
    # padded: 3 x 2 = 6 fits in 8, 3 x 3 = 9 does not; 5 x 2 = 10 does not either
    assert form_budget_batches([0, 1, 2, 3], [3, 3, 3, 5], 8, padded=True) == [[0, 1], [2], [3]]
    # padding-free: the samples' tokens, 3 + 3 = 6, + 3 = 9 > 8
    assert form_budget_batches([0, 1, 2, 3], [3, 3, 3, 5], 8, padded=False) == [[0, 1], [2, 3]]
    assert form_budget_batches([2, 0, 1], [4, 4, 4], 8, padded=False) == [[2, 0], [1]]  # the given order kept


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "padding_free"])
def test_every_micro_batch_keeps_the_budget(padded):
    lengths = random_lengths(500)
    for batch in form_budget_batches(list(range(500)), lengths, 128, padded):
        assert budget_cost([lengths[i] for i in batch], padded) <= 128
    # Not one sample per micro-batch: the budget is filled (a next sample would have broken it).
    batches = form_budget_batches(list(range(500)), lengths, 128, padded)
    assert len(batches) < 250


@pytest.mark.parametrize(("count", "ranks", "accumulation"), [(500, 2, 2), (333, 2, 3), (101, 4, 1), (50, 3, 2)])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "padding_free"])
def test_each_epoch_trains_every_sample_once_with_the_same_micro_batches_per_step_on_every_rank(
        count, ranks, accumulation, padded):
    lengths = random_lengths(count, seed=count)
    for epoch in range(3):
        shares = rank_batches(lengths, 128, padded, ranks, accumulation, epoch)
        assert len({len(share) for share in shares}) == 1  # every rank: as many micro-batches, so as many steps
        trained = sorted(i for share in shares for batch in share for i in batch)
        assert trained == list(range(count))
        for share in shares:
            assert all(budget_cost([lengths[i] for i in b], padded) <= 128 for b in share)


def test_a_step_holds_the_same_samples_on_two_ranks_as_on_one():
    """Parity: 2 ranks x 2 micro-batches per step take the samples that 1 rank x 4 does, the last step included
    (333 samples make an odd number of micro-batches, so the last step's fullest one is halved on 2 ranks)."""
    lengths = random_lengths(333, seed=3)
    for epoch in range(2):
        (alone,) = rank_batches(lengths, 128, True, 1, 4, epoch)
        pair = rank_batches(lengths, 128, True, 2, 2, epoch)
        one_steps = [sorted(i for b in alone[s:s + 4] for i in b) for s in range(0, len(alone), 4)]
        two_steps = [sorted(i for share in pair for b in share[s:s + 2] for i in b)
                     for s in range(0, len(pair[0]), 2)]
        assert one_steps == two_steps


def test_the_order_follows_the_seed_and_the_epoch_but_the_batches_stay():
    lengths = random_lengths(200)
    first = rank_batches(lengths, 128, True, 2, 2, epoch=0)
    assert first == rank_batches(lengths, 128, True, 2, 2, epoch=0)
    assert first != rank_batches(lengths, 128, True, 2, 2, epoch=1)
    assert first != rank_batches(lengths, 128, True, 2, 2, epoch=0, seed=8)
    as_sets = [sorted(map(tuple, share0 + share1)) for share0, share1 in
               (rank_batches(lengths, 128, True, 2, 2, epoch=e) for e in (0, 1))]
    assert as_sets[0] == as_sets[1]  # the same micro-batches (so the same number of steps), reordered


def test_the_heaviest_micro_batch_comes_first():
    lengths = [10] * 20 + [64]
    (share,) = rank_batches(lengths, 64, True, 1, 1, epoch=3)
    assert share[0] == [20]


def test_too_few_samples_for_the_ranks_repeat_micro_batches_as_distributed_sampler_does():
    shares = rank_batches([5], 64, True, 2, 1)
    assert shares == [[[0]], [[0]]]


def test_the_sampler_skips_micro_batches_and_counts_what_is_left():
    lengths = random_lengths(101, seed=5)
    batches = form_budget_batches(list(range(101)), lengths, 128, True)
    sampler = TokenBudgetBatches(batches, lengths, True, ranks=2, rank=1, accumulation=2, seed=7)
    sampler.set_epoch(2)
    whole = list(sampler)
    assert len(whole) == len(sampler) == -(-len(batches) // 2)
    sampler.start = 3
    assert list(sampler) == whole[3:] and len(sampler) == len(whole) - 3


def test_padding_free_rows_of_a_budget_hold_the_whole_micro_batch_in_one_row():
    collator = DataCollator(0, padding_free=True, row_tokens=16)
    features = [{"input_ids": [1] * n, "labels": [1] * n} for n in (5, 4, 4, 3)]
    batch = collator(features)
    assert tuple(batch["input_ids"].shape) == (1, 16)
    assert batch["position_ids"][0].tolist() == [*range(5), *range(4), *range(4), *range(3)]
    # Without a budget, rows hold as much as the longest sample (5): one row per sample here.
    assert DataCollator(0, padding_free=True)(features)["input_ids"].shape[0] == 4


class _Engine:
    world_size = 2
    data_parallel_size = 2

    def __init__(self, rank: int) -> None:
        self.rank = self.data_parallel_rank = rank


class _Tokenizer:
    pad_token_id = 0


def test_the_training_loader_deals_budget_batches_and_resumes_mid_epoch():
    from datasets import Dataset

    lengths = random_lengths(60, seed=9, longest=16)
    data = Dataset.from_dict({"input_ids": [[1] * n for n in lengths], "labels": [[1] * n for n in lengths]})
    config = build_config({"micro_batch_tokens": 32, "cutoff_len": 16, "padding_free": False,
                           "gradient_accumulation_steps": 2})
    loaders = [build_loader(data, _Tokenizer(), 4, _Engine(rank), config, True) for rank in (0, 1)]
    # The same count on both ranks, and more micro-batches than 4 samples each would make (8 per rank).
    assert len(loaders[0]) == len(loaders[1]) > -(-60 // (4 * 2))
    batches = [list(epoch_batches_for(loader)(1, 0)) for loader in loaders]
    assert sum(int(b["labels"].ne(-100).sum()) for share in batches for b in share) == sum(lengths)
    assert all(b["input_ids"].numel() <= 32 for share in batches for b in share)
    resumed = list(epoch_batches_for(loaders[0])(1, 2))
    assert [b["input_ids"].tolist() for b in resumed] == [b["input_ids"].tolist() for b in batches[0][2:]]


@pytest.mark.parametrize(("values", "expected"), [
    ({"micro_batch_tokens": 512, "cutoff_len": 1024}, "micro_batch_tokens (512) is below cutoff_len (1024)"),
    ({"micro_batch_tokens": 4096, "stage": "dpo"}, "micro_batch_tokens (4096) with stage (dpo)"),
    ({"micro_batch_tokens": 4096, "streaming": True, "max_steps": 5}, "micro_batch_tokens (4096) with streaming"),
    ({"micro_batch_tokens": 4096, "dataloader_drop_last": True},
     "micro_batch_tokens (4096) with dataloader_drop_last (true)"),
])
def test_micro_batch_tokens_problems_name_both_keys(values, expected):
    problems = cross_key_problems(build_config(values))
    assert any(expected in p for p in problems), problems


def test_micro_batch_tokens_below_one_is_refused_by_the_schema():
    from shardtune.errors import ConfigError

    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        build_config({"micro_batch_tokens": 0})


@pytest.mark.parametrize(("strategy", "expected"), [
    ("dynamic_batching", {"micro_batch_tokens": 4 * 512}),
    ("dynamic_padding_free", {"micro_batch_tokens": 4 * 512, "padding_free": True}),
])
def test_v1_dynamic_strategies_fill_cutoff_len_x_micro_batch_size_tokens(strategy, expected):
    values, problems = translate_v1({"model": "m", "micro_batch_size": 4, "cutoff_len": 512,
                                     "batching_strategy": strategy})
    assert problems == []
    assert {key: values.get(key) for key in expected} == expected
    defaults, _ = translate_v1({"model": "m", "batching_strategy": strategy})
    assert defaults["micro_batch_tokens"] == 2048  # v1's cutoff_len 2048 x micro_batch_size 1


def test_an_unknown_v1_strategy_is_refused_with_the_ones_there_are():
    _, problems = translate_v1({"model": "m", "batching_strategy": "bucketed"})
    assert problems[0].startswith(f"{V1_PREFIX}: key 'batching_strategy'") and "dynamic_padding_free" in problems[0]
