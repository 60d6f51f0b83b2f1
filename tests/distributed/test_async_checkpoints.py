"""async_save on 2 processes under every engine: the same losses as a synchronous run, and resuming from each of its
checkpoints (also on another number of processes) continues the uninterrupted curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import crash_after_checkpoint, run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

RUN = ("examples/tiny/sft_full.yaml", "max_steps=6", "save_steps=2", "logging_steps=1", "do_eval=false",
       "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=80", "gradient_accumulation_steps=2",
       "learning_rate=1e-3", "lr_scheduler_type=cosine", "warmup_steps=1", "per_device_train_batch_size=2",
       "save_total_limit=null")

ENGINES = {
    "ddp": (),
    "zero2": ("deepspeed=z2",),
    "zero3": ("deepspeed=z3",),
    "fsdp2": ("fsdp=full_shard auto_wrap",),
}
# FULL_STATE_DICT (gathered on rank 0, staged there) under FSDP1 and FSDP2: full fine-tuning only. FSDP1's sharded
# state dict (ShardedTensors) is refused with async_save before launch (torch's stager cannot copy them).
OTHER_LAYOUTS = {
    "fsdp1_full_state_dict": ("fsdp=full_shard auto_wrap",
                              "fsdp_config={'fsdp_version': 1, 'fsdp_state_dict_type': 'FULL_STATE_DICT'}"),
    "fsdp2_full_state_dict": ("fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_state_dict_type': 'FULL_STATE_DICT'}"),
    "zero3_sp2": ("deepspeed=z3", "sequence_parallel_size=2"),  # both ranks read the same rows, each half of each
}
IN_MAKE_TEST = {"zero3-lora"}  # the rest: make test-matrix
CELLS = [pytest.param(engine, method, marks=() if f"{engine}-{method}" in IN_MAKE_TEST else pytest.mark.matrix,
                      id=f"{engine}-{method}") for engine in ENGINES for method in ("full", "lora")]
CELLS += [pytest.param(engine, "full", marks=pytest.mark.matrix, id=f"{engine}-full") for engine in OTHER_LAYOUTS]
ENGINES.update(OTHER_LAYOUTS)


def train(model: Path, out: Path, nproc: int, *extra: str, overwrite: bool = True):
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(nproc)} if nproc > 1 else {}
    result = run_cli("train", *RUN, f"model_name_or_path={model}", f"output_dir={out}",
                     f"overwrite_output_dir={str(overwrite).lower()}", *extra, **env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]


def losses_by_step(out: Path) -> dict[int, float]:
    return {r["current_steps"]: r["loss"] for r in records(out) if "loss" in r}


def resume_from(finished: Path, step: int, model: Path, nproc: int, *extra: str) -> dict[int, float]:
    """The finished run cut off right after checkpoint-``step``, resumed: its losses by step."""
    crashed = finished.with_name(f"{finished.name}-cut{step}-{nproc}")
    crash_after_checkpoint(finished, crashed, step)
    result = train(model, crashed, nproc, *extra, overwrite=False)
    assert f"resuming from {crashed / f'checkpoint-{step}'}" in result.stdout
    return losses_by_step(crashed)


@pytest.mark.parametrize(("engine", "method"), CELLS)
def test_async_save_trains_like_sync_and_each_checkpoint_resumes_the_curve(engine, method, tiny_model_dir, tmp_path):
    extra = (*ENGINES[engine], f"finetuning_type={method}")
    sync, background = tmp_path / "sync", tmp_path / "async"
    train(tiny_model_dir, sync, 2, *extra)
    train(tiny_model_dir, background, 2, *extra, "async_save=true")
    expected = losses_by_step(sync)
    assert losses_by_step(background) == expected  # the same computation: staging changes no number
    saves = [r for r in records(background) if "checkpoint" in r]
    assert [r["current_steps"] for r in saves] == [2, 4, 6] and all(r["async_save"] for r in saves)
    for step in (2, 4):
        resumed = resume_from(background, step, tiny_model_dir, 2, *extra, "async_save=true")
        assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
        for later in range(step + 1, 7):
            assert resumed[later] == pytest.approx(expected[later], rel=1e-5), (step, later, resumed, expected)


@pytest.mark.matrix
@pytest.mark.parametrize("engine", ["zero2", "fsdp2"])
def test_an_async_checkpoint_of_two_processes_resumes_on_one(engine, tiny_model_dir, tmp_path):
    background = tmp_path / "async"
    train(tiny_model_dir, background, 2, *ENGINES[engine], "async_save=true")
    expected = losses_by_step(background)
    # One process with twice the micro-batch: the same global batch, rows and order.
    resumed = resume_from(background, 4, tiny_model_dir, 1, *ENGINES[engine], "per_device_train_batch_size=4")
    for later in (5, 6):
        assert resumed[later] == pytest.approx(expected[later], rel=2e-3), (later, resumed, expected)
