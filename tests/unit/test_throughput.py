"""Length grouping, the throughput meter and the throughput benchmark's command building."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from shardtune.data.sampling import LengthGroupedSampler, length_grouped_order
from shardtune.train.throughput import ThroughputMeter

REPO = Path(__file__).resolve().parents[2]


def padded_slots(order: list[int], lengths: list[int], batch: int) -> int:
    return sum(batch * max(lengths[i] for i in order[k:k + batch]) for k in range(0, len(order), batch))


def test_length_grouped_order_is_a_permutation_with_far_less_padding() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(5, 300) for _ in range(1000)]
    order = length_grouped_order(lengths, global_batch=8, seed=1)
    assert sorted(order) == list(range(1000))
    shuffled = list(range(1000))
    rng.shuffle(shuffled)
    real = sum(lengths)
    grouped_padding = 1 - real / padded_slots(order, lengths, 8)
    random_padding = 1 - real / padded_slots(shuffled, lengths, 8)
    assert grouped_padding < 0.05 < 0.3 < random_padding


def test_length_grouped_order_is_deterministic_per_seed_and_puts_the_longest_first() -> None:
    lengths = [random.Random(2).randint(1, 50) for _ in range(200)]
    lengths[137] = 999
    first = length_grouped_order(lengths, global_batch=4, seed=3)
    assert first == length_grouped_order(lengths, global_batch=4, seed=3)
    assert first != length_grouped_order(lengths, global_batch=4, seed=4)
    assert 137 in first[:4]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_length_grouped_sampler_deals_out_every_sample_like_distributed_sampler(world: int) -> None:
    lengths = [random.Random(world).randint(1, 100) for _ in range(101)]
    samplers = [LengthGroupedSampler(lengths, 4, world, rank, seed=0) for rank in range(world)]
    plain = DistributedSampler(range(101), num_replicas=world, rank=0, seed=0)
    shares = [list(s) for s in samplers]
    assert all(len(share) == len(plain) == len(s) for share, s in zip(shares, samplers, strict=True))
    assert set().union(*shares) == set(range(101))
    # The same micro-batch index on every rank holds neighbours in length order: similar lengths across ranks.
    first_global_batch = [i for share in shares for i in share[:4]]
    assert max(lengths[i] for i in first_global_batch) == max(lengths)
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != shares[0]


def test_throughput_meter_leaves_out_warmup_and_counts_padding() -> None:
    meter = ThroughputMeter(warmup_steps=1)
    meter.start()
    steps = [(100.0, 200.0, 2.0, 50.0), (300.0, 400.0, 1.0, 150.0), (300.0, 400.0, 3.0, 150.0)]
    for tokens, slots, loss, trainable in steps:
        meter.record({"tokens": tokens, "slots": slots, "loss": loss, "trainable_tokens": trainable})
    meter.step_seconds = [5.0, 1.0, 2.0]  # deterministic times
    summary = meter.summary()
    assert summary["effective_tokens_per_second"] == pytest.approx(600 / 3)
    assert summary["padding_fraction"] == pytest.approx(1 - 700 / 1000)
    assert summary["step_time_median_seconds"] == pytest.approx(1.5)
    assert summary["loss_per_token"] == pytest.approx((2 * 50 + 1 * 150 + 3 * 150) / 350)
    assert summary["warmup_steps"] == 1 and summary["measured_steps"] == 2
    assert summary["first_step_unix_time"] is not None


def test_throughput_meter_leaves_out_the_profiled_steps() -> None:
    meter = ThroughputMeter(warmup_steps=1)
    for index, tokens in enumerate([100.0, 300.0, 300.0, 300.0]):
        meter.record({"tokens": tokens, "loss": 1.0, "trainable_tokens": 5.0}, profiled=index in (1, 2))
    meter.step_seconds = [5.0, 9.0, 9.0, 1.0]  # the profiler slowed steps 2 and 3
    summary = meter.summary()
    assert summary["effective_tokens_per_second"] == pytest.approx(300.0)
    assert summary["measured_steps"] == 1 and summary["profiled_steps"] == 2
    assert summary["step_time_median_seconds"] == pytest.approx(1.0)


def test_throughput_meter_keeps_one_step_when_the_run_is_shorter_than_warmup() -> None:
    meter = ThroughputMeter(warmup_steps=5)
    meter.record({"tokens": 10.0, "loss": 1.0, "trainable_tokens": 5.0})
    summary = meter.summary()
    assert summary["measured_steps"] == 1 and summary["effective_tokens_per_second"] > 0
    assert summary["padding_fraction"] == 0


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("throughput_bench", REPO / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name)
    sys.path.remove(str(REPO / "benchmarks"))


def test_benchmark_commands_are_argv_lists_with_real_engines_for_one_process(bench, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_TORCHRUN", raising=False)
    specs = bench.engine_specs(["ddp", "zero3", "fsdp"], [1, 2], steps=5, warmup=2)
    assert [(s.label, s.procs) for s in specs] == [("local", 1), ("ZeRO-3", 1), ("FSDP FULL_SHARD", 1),
                                                   ("DDP", 2), ("ZeRO-3", 2), ("FSDP FULL_SHARD", 2)]
    argv, env = bench.command_for(specs[1], "examples/tiny/sft_full.yaml", tmp_path)
    assert argv[-4:] == ["max_steps=7", "throughput_warmup_steps=2", "packing=true",
                         "deepspeed=examples/deepspeed/ds_z3_config.json"]
    assert env["NPROC_PER_NODE"] == "1" and env["FORCE_TORCHRUN"] == "1"
    assert "FORCE_TORCHRUN" not in bench.command_for(specs[0], "x.yaml", tmp_path)[1]
    packing = bench.packing_specs()
    assert [s.label for s in packing] == ["padded", "padded, grouped by length", "packed"]
    assert all("learning_rate=1e-9" in s.overrides for s in packing)


def test_benchmark_packing_summary_compares_with_the_padded_run(bench) -> None:
    rows = [{"suite": "packing", "variant": "padded", "effective_tokens_per_second": 100.0, "loss_per_token": 8.0},
            {"suite": "packing", "variant": "packed", "effective_tokens_per_second": 190.0, "loss_per_token": 8.0008}]
    summary = bench.packing_summary(rows)
    assert summary["packed_over_padded"] == pytest.approx(1.9)
    assert summary["loss_per_token_relative_difference"]["packed"] == pytest.approx(1e-4)


def test_the_profilers_start_and_summary_are_no_steps_time(monkeypatch) -> None:
    """The profiler's summary after its last step took tens of seconds on an H100 and landed in the next measured
    step: 4.8k tokens/s reported for a run whose median step gave 41k (2026-11-28). A fake clock: each step takes
    1 s, starting and stopping the profiler 100 s each."""
    import shardtune.train.throughput as throughput
    from shardtune.train.hooks import record_step

    now = [0.0]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: now[0])

    class SlowProfile:  # profiles steps 2 and 3 (indices 1, 2)
        def __init__(self) -> None:
            self.seen, self.active = 0, False

        def after_step(self) -> None:
            self.seen += 1
            if self.seen in (1, 3):
                now[0] += 100.0
                self.active = self.seen == 1

    meter = ThroughputMeter(warmup_steps=0)
    meter.start()
    profile = SlowProfile()
    for _ in range(5):
        now[0] += 1.0
        record_step(meter, profile, {"tokens": 100, "loss": 1.0, "trainable_tokens": 100})
    assert meter.profiled == {1, 2}
    assert meter.step_seconds == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert meter.summary()["effective_tokens_per_second"] == 100.0
