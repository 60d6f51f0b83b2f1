"""Stage grpo on 2 processes against one process with the same global batch, through the real CLI.

Each prompt's completions are seeded by its row number (train/rollout.py), so both runs sample the same completions
for the same prompts whatever rank holds them: 2 gloo processes under DDP, ZeRO-2, ZeRO-3, FSDP2 and FSDP1 (the
policy generating with its sharded weights gathered, ``synced_gpus``), full fine-tuning with a frozen reference
placed as the policy and LoRA with its adapters-off reference (beta > 0), must log the one-process run's per-step
loss, gradient norm, reward, completion length and KL. Gradient accumulation is 2, so a step sums 4 groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.distributed.helpers import ENGINE_KEYS, logged, train_with

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

COMMON = ("examples/grpo/tiny_letter.yaml", "max_steps=3", "save_strategy=no", "gradient_accumulation_steps=2",
          "beta=0.04", "max_completion_length=8")
KINDS = {"full": ("finetuning_type=full", "learning_rate=1e-2"),
         "lora": ("finetuning_type=lora", "lora_target=all", "learning_rate=5e-2")}
RUNS = [(engine, kind) for engine in ("ddp", "zero2", "zero3", "fsdp2", "fsdp1") for kind in KINDS]
COMPARED = ("loss", "grad_norm", "reward", "completions/mean_length", "kl")


def train(model: Path, out: Path, nproc: int, micro: int, *extra: str) -> dict:
    return train_with(COMMON, model, out, nproc, micro, *extra)


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> Callable[[str], Path]:
    """``one_process(kind)``: 2 prompts (8 completions) per micro-batch, trained when a selected cell first asks."""
    @functools.cache
    def run(kind: str) -> Path:
        out = tmp_path_factory.mktemp(f"one-{kind}")
        train(tiny_model_dir, out, 1, 8, *KINDS[kind])
        return out

    return run


@pytest.mark.parametrize(("engine", "kind"), RUNS, ids=[f"{e}-{k}" for e, k in RUNS])
def test_grpo_matches_one_process(engine, kind, one_process, tiny_model_dir, tmp_path):
    results = train(tiny_model_dir, tmp_path / "two", 2, 4, *KINDS[kind], *ENGINE_KEYS[engine])
    assert results["world_size"] == 2
    reference = one_process(kind)
    assert len(logged(reference, "loss")) == 3 and max(logged(reference, "kl")) > 0
    for key in COMPARED:
        assert logged(tmp_path / "two", key) == pytest.approx(logged(reference, key), rel=2e-3, abs=1e-5), key


@pytest.mark.parametrize("processes", [1, 2], ids=["same-1", "then-2"])
def test_a_resumed_run_samples_the_same_prompts_and_continues_the_curve(processes, tiny_model_dir, tmp_path):
    """A one-process run that died right after checkpoint-2 resumes on 1 or on 2 processes (DDP) and logs the
    uninterrupted run's steps 3 and 4: the same prompts (the sampler's cursor is the step), the same completions (seeded
    by row) and the same updates (weights, optimizer and reference restored)."""
    from tests.conftest import crash_after_checkpoint

    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    keys = (*KINDS["full"], "max_steps=4", "save_strategy=steps", "save_steps=2")
    train(tiny_model_dir, finished, 1, 8, *keys)
    crash_after_checkpoint(finished, crashed, 2)
    train(tiny_model_dir, crashed, processes, 8 // processes, *keys, "overwrite_output_dir=false")
    for key in COMPARED:
        expected, resumed = logged(finished, key), logged(crashed, key)
        assert len(resumed) == 4 and resumed[2:] == pytest.approx(expected[2:], rel=2e-3, abs=1e-5), key


@pytest.fixture(scope="module")
def finished_with_repeats(tiny_model_dir, tmp_path_factory) -> Path:
    """One process, num_iterations 2 (each window trained twice on its rollouts), a checkpoint after every step."""
    out = tmp_path_factory.mktemp("repeats")
    train(tiny_model_dir, out, 1, 8, *REPEATS)
    return out


REPEATS = (*KINDS["full"], "num_iterations=2", "max_steps=4", "save_strategy=steps", "save_steps=1")


@pytest.mark.parametrize("processes", [1, 2], ids=["same-1", "then-2"])
def test_a_run_resumed_between_two_repeats_of_a_window_trains_on_the_same_rollouts(
        processes, finished_with_repeats, tiny_model_dir, tmp_path):
    """Died right after checkpoint-1, the first of two steps on one window's rollouts: resumed on 1 or 2 processes,
    the second step trains on the checkpoint's rollouts and old log-probabilities (rows as keys, whichever rank
    holds them now) and the run logs the uninterrupted run's steps 2 to 4. The checkpoint at a window's end carries
    none (nothing is left to repeat)."""
    from tests.conftest import crash_after_checkpoint

    assert len(list((finished_with_repeats / "checkpoint-1").glob("rank*_grpo_rollouts.pt"))) == 1
    assert not list((finished_with_repeats / "checkpoint-2").glob("rank*_grpo_rollouts.pt"))
    crashed = tmp_path / "crashed"
    crash_after_checkpoint(finished_with_repeats, crashed, 1)
    train(tiny_model_dir, crashed, processes, 8 // processes, *REPEATS, "overwrite_output_dir=false")
    for key in (*COMPARED, "clip_ratio/low_mean", "clip_ratio/high_mean"):
        expected, resumed = logged(finished_with_repeats, key), logged(crashed, key)
        assert len(resumed) == 4 and resumed[1:] == pytest.approx(expected[1:], rel=2e-3, abs=1e-5), key
