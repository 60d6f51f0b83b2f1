"""``streaming: true`` through the real CLI on one process: trains past the end of the stream (several passes),
evaluates on a val_size hold-out, and a resumed run repeats the straight run's losses exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# 2 datasets x 8 records, 4 held out: 12 training records = 1.5 steps of 8, so 6 steps read 4 passes.
COMMON = ("examples/tiny/sft_full.yaml", "streaming=true", "buffer_size=16", "max_samples=8", "val_size=4",
          "max_steps=6", "save_steps=3", "logging_steps=1", "eval_steps=3", "per_device_train_batch_size=2",
          "gradient_accumulation_steps=4", "lr_scheduler_type=cosine", "warmup_steps=1", "plot_loss=false")


def log_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if line.strip()]


def train_losses(out: Path) -> dict[int, float]:
    return {r["current_steps"]: r["loss"] for r in log_records(out) if "loss" in r}


def train(model: Path, out: Path, *extra: str) -> None:
    result = run_cli("train", *COMMON, f"model_name_or_path={model}", f"output_dir={out}", *extra)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def test_streaming_trains_evaluates_and_resumes_exactly(tiny_model_dir, tmp_path):
    straight = tmp_path / "straight"
    train(tiny_model_dir, straight)
    results = json.loads((straight / "train_results.json").read_text())
    assert results["global_step"] == 6 and results["world_size"] == 1
    losses = train_losses(straight)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1]
    evals = [r["eval_loss"] for r in log_records(straight) if "eval_loss" in r]
    assert len(evals) == 2 and all(value == value for value in evals)  # steps 3 and 6, no NaN
    assert "eval_loss" in results

    crashed = tmp_path / "crashed"
    shutil.copytree(straight, crashed)
    # A crash after step 3: only the first checkpoint and the log up to it survive.
    for name in ("model.safetensors", "train_results.json"):
        (crashed / name).unlink()
    shutil.rmtree(crashed / "checkpoint-6")
    kept = [line for line in (crashed / "trainer_log.jsonl").read_text().splitlines()
            if json.loads(line)["current_steps"] <= 3]
    (crashed / "trainer_log.jsonl").write_text("\n".join(kept) + "\n")
    result = run_cli("train", *COMMON, f"model_name_or_path={tiny_model_dir}", f"output_dir={crashed}",
                     "overwrite_output_dir=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    resumed = train_losses(crashed)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):  # steps 4-6 read passes 2-4 of the stream: the same samples in the same order
        assert resumed[step] == pytest.approx(losses[step], rel=1e-5), (step, resumed, losses)


def test_streaming_pt_with_packing(tiny_model_dir, tmp_path):
    out = tmp_path / "pt"
    result = run_cli("train", "examples/tiny/pt_full.yaml", f"model_name_or_path={tiny_model_dir}",
                     f"output_dir={out}", "streaming=true", "max_steps=3", "logging_steps=1", "save_strategy=no",
                     "plot_loss=false", "val_size=0", "do_eval=false", "eval_strategy=no")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(train_losses(out)) == [1, 2, 3]
