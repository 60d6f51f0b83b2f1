"""``streaming: true`` on 2 processes: each rank reads a disjoint share of the stream, and together they train
on the same samples per step as one process with the global batch, so the losses match.

One file and ``buffer_size: 1`` keep the stream in file order; rank r then takes records r, r+2, ... With
micro-batches of 2 per rank against 4 on one process, every accumulation window holds the same 8 samples, and the
token-normalised loss is the same. The run is longer than the stream (12 - 4 held out = 8 records, 4 steps of 8
samples), so the ranks read their shares four times over.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import logged, losses

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

COMMON = ("examples/tiny/sft_full.yaml", "dataset=demo", "streaming=true", "buffer_size=1", "max_samples=12",
          "val_size=4", "max_steps=4", "logging_steps=1", "save_strategy=no", "eval_strategy=steps", "eval_steps=2",
          "plot_loss=false", "gradient_accumulation_steps=2", "learning_rate=1e-3", "lr_scheduler_type=constant",
          "warmup_ratio=0")


def train(model: Path, out: Path, nproc: int, micro: int, *extra: str) -> dict:
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(nproc)} if nproc > 1 else {}
    result = run_cli("train", *COMMON, f"model_name_or_path={model}", f"output_dir={out}",
                     f"per_device_train_batch_size={micro}", "per_device_eval_batch_size=2", *extra, **env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((out / "train_results.json").read_text())


def eval_losses(out: Path) -> list[float]:
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["eval_loss"] for r in records if "eval_loss" in r]


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stream-1")
    train(tiny_model_dir, out, 1, 4)
    return out


@pytest.mark.parametrize("engine", [(), ("fsdp=full_shard auto_wrap",)], ids=["ddp", "fsdp2-full_shard"])
def test_two_rank_stream_matches_one_process(engine, one_process, tiny_model_dir, tmp_path):
    results = train(tiny_model_dir, tmp_path, 2, 2, *engine)
    assert results["world_size"] == 2 and results["global_step"] == 4
    assert len(losses(tmp_path)) == 4
    assert losses(tmp_path) == pytest.approx(losses(one_process), rel=2e-3)
    assert logged(tmp_path, "grad_norm") == pytest.approx(logged(one_process, "grad_norm"), rel=2e-3)
    # The held-out samples are read whole on every rank and dealt out evenly: the same eval losses too.
    assert len(eval_losses(tmp_path)) == 2
    assert eval_losses(tmp_path) == pytest.approx(eval_losses(one_process), rel=2e-3)
