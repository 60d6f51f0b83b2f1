"""async_save on a GPU: the shards are staged into pinned host memory and written in the background; the losses equal
the synchronous run's and a resume from an async checkpoint continues the curve."""

from __future__ import annotations

import json

import pytest

from tests.conftest import crash_after_checkpoint
from tests.gpu.helpers import GPUS, needs_gpu, train

pytestmark = needs_gpu()

ENGINES = {"local": (), "fsdp2": ("fsdp=full_shard auto_wrap",), "zero3": ("deepspeed=z3",)}


def losses_by_step(out) -> dict[int, float]:
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return {r["current_steps"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_async_save_on_the_gpu_matches_sync_and_resumes(engine, tiny_model_dir, tmp_path):
    processes = 0 if engine == "local" else max(GPUS, 1)
    saves = ("save_strategy=steps", "save_steps=2", "save_total_limit=null", *ENGINES[engine])
    sync = train(tiny_model_dir, tmp_path / "sync", "full", *saves, processes=processes)
    background = train(tiny_model_dir, tmp_path / "async", "full", *saves, "async_save=true", processes=processes)
    assert losses_by_step(background.out) == losses_by_step(sync.out)
    marker = json.loads((background.out / "checkpoint-2" / "COMPLETE").read_text())
    assert marker["async_save"] is True
    cut = tmp_path / "cut"
    crash_after_checkpoint(background.out, cut, 2)
    resumed = train(tiny_model_dir, cut, "full", *saves, "async_save=true", "overwrite_output_dir=false",
                    processes=processes)
    assert f"resuming from {cut / 'checkpoint-2'}" in resumed.process.stdout
    expected, losses = losses_by_step(sync.out), losses_by_step(cut)
    for step in sorted(expected):
        if step > 2:
            assert losses[step] == pytest.approx(expected[step], rel=1e-2), (step, losses, expected)
