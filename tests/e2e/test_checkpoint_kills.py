"""Kill test: a rank dies by SIGKILL at each instant of a save (before staging, in the middle of each file, before
and after the COMPLETE marker, during rotation). Every time, the next run resumes from the newest complete
checkpoint and continues the uninterrupted curve; no partial checkpoint is picked and no older complete one lost.

The harness names the instant through ``SHARDTUNE_TEST_KILL_AT`` (engines/checkpoint_writer.py ``fault_point``):
``point#n@rank`` kills the process at the n-th visit of ``point`` on that rank. The runs save at steps 2, 4 and 6
with ``save_total_limit: 1``; the kills hit the save of step 4, whose files are the 5th to 8th written (the
trainable weights, the optimizer, the scheduler, the RNG state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.engines.checkpoint_writer import KILL_AT_VARIABLE
from shardtune.train.checkpoint_folders import checkpoint_problems, complete_checkpoints
from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

RUN = ("examples/tiny/sft_full.yaml", "max_steps=6", "save_steps=2", "save_total_limit=1", "logging_steps=1",
       "do_eval=false", "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=64",
       "per_device_train_batch_size=2", "gradient_accumulation_steps=1", "learning_rate=1e-3")

# instant -> the newest complete checkpoint it leaves (the save of step 4 is the one cut)
INSTANTS = {
    "stage#2": 2,  # before anything of checkpoint-4 was staged
    "write-file#5": 2,  # in the middle of its first file (the weights)
    "write-file#6": 2,  # ... the optimizer state
    "write-file#7": 2,  # ... the scheduler
    "write-file#8": 2,  # ... the RNG state
    "staged#2": 2,  # everything staged, written in the background (async) or written (sync)
    "before-marker#2": 2,  # every file written and fsynced, no marker yet
    "after-marker#2": 4,  # marked complete, checkpoint-2 not yet rotated out
    "rotate#1": 4,  # checkpoint-2 renamed out of the way, not yet deleted
}
IN_MAKE_TEST = {("async", "write-file#6"), ("sync", "before-marker#2")}  # the rest: make test-matrix


def cells():
    for mode in ("async", "sync"):
        for instant in INSTANTS:
            marks = () if (mode, instant) in IN_MAKE_TEST else pytest.mark.matrix
            yield pytest.param(mode, instant, marks=marks, id=f"{mode}-{instant}")


def train(model: Path, out: Path, *extra: str, overwrite: bool, **env: str):
    return run_cli("train", *RUN, f"model_name_or_path={model}", f"output_dir={out}",
                   f"overwrite_output_dir={str(overwrite).lower()}", *extra, **env)


def losses_by_step(out: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return {r["current_steps"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = train(tiny_model_dir, out, overwrite=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses_by_step(out)


def assert_only_complete_checkpoints_are_picked(out: Path, newest: int) -> None:
    complete = complete_checkpoints(out)
    assert complete and complete[-1].name == f"checkpoint-{newest}", complete
    for folder in complete:
        assert checkpoint_problems(folder) == [], folder


def assert_resumes_the_curve(resumed, out: Path, newest: int, uninterrupted: dict[int, float], rel: float) -> None:
    """The run after the kill resumed from checkpoint-``newest``, logged the uninterrupted losses after it, and ended
    with only its final checkpoint complete (save_total_limit: 1)."""
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / f'checkpoint-{newest}'}" in resumed.stdout
    losses = losses_by_step(out)
    for step in range(newest + 1, 7):
        assert losses[step] == pytest.approx(uninterrupted[step], rel=rel), (step, losses, uninterrupted)
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-6"]


@pytest.mark.parametrize(("mode", "instant"), list(cells()))
def test_a_kill_at_any_instant_of_a_save_resumes_from_the_newest_complete_checkpoint(
        mode, instant, uninterrupted, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    asynchronous = f"async_save={str(mode == 'async').lower()}"
    killed = train(tiny_model_dir, out, asynchronous, overwrite=True, **{KILL_AT_VARIABLE: instant})
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])  # died at the instant, by SIGKILL
    newest = INSTANTS[instant]
    assert_only_complete_checkpoints_are_picked(out, newest)
    assert_resumes_the_curve(train(tiny_model_dir, out, asynchronous, overwrite=False), out, newest, uninterrupted,
                             rel=1e-5)
    assert not list(out.glob(".deleting-*"))


TWO_RANKS = {  # engine, instant -> newest complete checkpoint left
    ("zero2", "write-file#3@1"): 2,  # rank 1 in the middle of its ZeRO partition of checkpoint-4
    ("fsdp2", "staged#2@1"): 2,  # rank 1 staged its shards, torch's writer thread still writing
    ("ddp", "before-marker#2@0"): 2,  # rank 0 about to mark checkpoint-4 complete
}
ENGINE_KEYS = {"ddp": (), "zero2": ("deepspeed=z2",), "fsdp2": ("fsdp=full_shard auto_wrap",)}


@pytest.mark.distributed
@pytest.mark.parametrize(("engine", "instant"), [
    pytest.param(*cell, marks=() if cell[0] == "zero2" else pytest.mark.matrix, id=f"{cell[0]}-{cell[1]}")
    for cell in TWO_RANKS])
def test_a_rank_killed_during_an_async_save_of_two_resumes_from_the_newest_complete_checkpoint(
        engine, instant, uninterrupted, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    two = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}
    keys = (*ENGINE_KEYS[engine], "async_save=true", "per_device_train_batch_size=1")  # the same global batch
    killed = train(tiny_model_dir, out, *keys, overwrite=True, **two, **{KILL_AT_VARIABLE: instant})
    assert killed.returncode not in (0, 2), killed.stderr[-3000:]
    newest = TWO_RANKS[(engine, instant)]
    assert_only_complete_checkpoints_are_picked(out, newest)
    assert_resumes_the_curve(train(tiny_model_dir, out, *keys, overwrite=False, **two), out, newest, uninterrupted,
                             rel=2e-3)
