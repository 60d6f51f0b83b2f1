"""A real training run with report_to: wandb (offline), mlflow (local file store) and tensorboard records the loss
curve rank 0 logs in trainer_log.jsonl, and the resolved config, in each tracker. A tracker server or hub that
would leave the run waiting is named in one line, within a bounded time, exit 2, no process left; every address
here is loopback or under the reserved .invalid domain."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, cli_env, run_cli

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


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_bounded(*args: str, limit: float, **env: str) -> tuple[int, list[str], float]:
    """The CLI in a process group of its own: exit code, stderr lines, seconds taken. It must end within ``limit``
    and leave no process of its group behind."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", *args], cwd=REPO, env=cli_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"shardtune {args[0]} still waiting after {limit} s")
    took = time.monotonic() - start
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its group is left
    return proc.returncode, [line for line in err.splitlines() if line.strip()], took


def train_args(model, out, *extra: str) -> list[str]:
    return ["train", "examples/tiny/sft_lora.yaml", f"model_name_or_path={model}", f"output_dir={out}",
            "max_steps=1", "do_eval=false", "plot_loss=false", *extra]


def errors(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("shardtune: error:")]


@pytest.mark.parametrize("command", ["check", "train"])
def test_an_mlflow_server_that_does_not_answer_is_one_line_before_launch(command, tiny_model_dir, tmp_path):
    pytest.importorskip("mlflow")
    uri = f"http://127.0.0.1:{closed_port()}"
    args = train_args(tiny_model_dir, tmp_path / "run", "report_to=mlflow")
    code, lines, took = run_bounded(command, *args[1:], limit=60, MLFLOW_TRACKING_URI=uri)
    (line,) = errors(lines)
    assert code == 2 and f"MLFLOW_TRACKING_URI ({uri}): the tracking server did not answer" in line, lines
    assert not (tmp_path / "run" / "trainer_log.jsonl").exists()
    print(f"{command}: refused in {took:.1f} s")


def test_wandb_without_a_login_is_one_line_before_launch(tiny_model_dir, tmp_path):
    pytest.importorskip("wandb")
    (tmp_path / "netrc").write_text("")
    code, lines, took = run_bounded(*train_args(tiny_model_dir, tmp_path / "run", "report_to=wandb"), limit=60,
                                    WANDB_MODE="online", WANDB_API_KEY="", NETRC=str(tmp_path / "netrc"),
                                    WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))
    (line,) = errors(lines)
    assert code == 2 and "report_to (wandb): no W&B credentials" in line and "wandb login" in line, lines
    print(f"refused in {took:.1f} s")


def test_an_unresolvable_wandb_server_is_named_and_the_key_never_shown(tiny_model_dir, tmp_path):
    pytest.importorskip("wandb")
    secret = "wandb-secret-" + "7" * 30
    code, lines, took = run_bounded(*train_args(tiny_model_dir, tmp_path / "run", "report_to=wandb"), limit=60,
                                    WANDB_MODE="online", WANDB_API_KEY=secret,
                                    WANDB_BASE_URL="https://wandb.tracker.invalid")
    (line,) = errors(lines)
    assert code == 2 and "WANDB_BASE_URL (https://wandb.tracker.invalid)" in line, lines
    assert "did not resolve" in line and not any(secret in text for text in lines)
    print(f"refused in {took:.1f} s")


@pytest.fixture
def hub_env(tmp_path):
    """An empty Hugging Face cache, and no token (nothing here may reach a real hub)."""
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_TOKEN": "",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_an_uncached_hub_id_in_offline_mode_is_one_line_before_launch(hub_env, tmp_path):
    code, lines, took = run_bounded(*train_args("someorg/somemodel", tmp_path / "run",
                                                "build_tiny_model_if_missing=false"), limit=60,
                                    HF_HUB_OFFLINE="1", **hub_env)
    (line,) = errors(lines)
    assert code == 2 and "someorg/somemodel is not in the Hugging Face cache and HF_HUB_OFFLINE=1" in line, lines
    assert "hf download someorg/somemodel" in line
    print(f"refused in {took:.1f} s")


def test_a_hub_that_does_not_answer_ends_in_one_line_naming_the_id_and_endpoint(hub_env, tmp_path):
    """The download is asked for on the launching host before any rank starts (shardtune.hub), within
    huggingface_hub's own timeouts (10 s a try), and the last line says what it waited for."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    code, lines, took = run_bounded(*train_args("someorg/somemodel", tmp_path / "run",
                                                "build_tiny_model_if_missing=false"), limit=120,
                                    HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0", HF_ENDPOINT=endpoint, **hub_env)
    assert code == 2, lines
    assert lines[-1].startswith("shardtune: error: model_name_or_path: someorg/somemodel is not in the Hugging Face "
                                f"cache and the hub (HF_ENDPOINT {endpoint}) did not answer"), lines[-1]
    assert "hf download someorg/somemodel" in lines[-1]
    print(f"ended in {took:.1f} s")
