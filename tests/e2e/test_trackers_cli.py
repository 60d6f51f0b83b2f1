"""A real training run with report_to: wandb (offline), mlflow (local file store) and tensorboard records the loss
curve rank 0 logs in trainer_log.jsonl, and the resolved config, in each tracker."""

from __future__ import annotations

import json
import struct

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def wandb_records(path):
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, found = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
    return found


def test_wandb_offline_and_mlflow_record_the_loss_curve_and_config(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    done = run_cli("train", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}",
                   f"output_dir={out}", "max_steps=6", "logging_steps=2", "save_steps=100", "do_eval=false",
                   "report_to=wandb,mlflow,tensorboard", "run_name=tracked", "plot_loss=false",
                   WANDB_MODE="offline", WANDB_SILENT="true", WANDB_PROJECT="shardtune-test")
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [(r["current_steps"], r["loss"]) for r in map(json.loads, (out / "trainer_log.jsonl").open())
              if "loss" in r]
    assert [step for step, _ in logged] == [2, 4, 6]

    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h] == logged, history
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run.display_name == "tracked" and config["max_steps"] == 6 and config["finetuning_type"] == "lora"

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when told
    client = MlflowClient((out / "mlruns").as_uri())
    (mlrun,) = client.search_runs([client.get_experiment_by_name("shardtune").experiment_id])
    history = client.get_metric_history(mlrun.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == logged
    assert mlrun.data.params["max_steps"] == "6" and mlrun.info.run_name == "tracked"
    assert json.loads((out / "mlruns").joinpath(mlrun.info.experiment_id, mlrun.info.run_id, "artifacts",
                                                "shardtune_config.json").read_text())["run_name"] == "tracked"
    assert list((out / "runs").glob("events.out.tfevents.*"))
