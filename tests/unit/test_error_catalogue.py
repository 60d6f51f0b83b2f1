"""The catalogue of bad inputs: each gives exit code 2 and one line naming the key, file or line. No traceback.

Every case id also appears in the README's troubleshooting table (checked below).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shardtune.cli import main
from tests.conftest import REPO

DATA = REPO / "data"


@dataclass
class Case:
    id: str
    fragment: str
    edit: dict = field(default_factory=dict)  # config values to add or replace (None removes)
    env: dict = field(default_factory=dict)
    prepare: Callable[[Path], dict] | None = None  # writes files, returns more config edits
    command: str = "check"
    raw_yaml: str | None = None


def jsonl_dataset(tmp: Path, lines: list[str], formatting: str = "alpaca", columns: dict | None = None) -> dict:
    (tmp / "bad.jsonl").write_text("\n".join(lines) + "\n")
    entry = {"file_name": "bad.jsonl", "formatting": formatting, **({"columns": columns} if columns else {})}
    (tmp / "dataset_info.json").write_text(json.dumps({"bad": entry}))
    return {"dataset": "bad", "dataset_dir": str(tmp)}


def ds_json(tmp: Path, text: str) -> dict:
    (tmp / "ds.json").write_text(text)
    return {"deepspeed": str(tmp / "ds.json")}


def finished_output(tmp: Path) -> dict:
    (tmp / "out").mkdir()
    (tmp / "out" / "train_results.json").write_text("{}")
    return {"output_dir": str(tmp / "out"), "overwrite_output_dir": False}


def taken_port(tmp: Path) -> dict:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    taken_port.keep = sock  # held open while the CLI runs
    return {"__env__": {"MASTER_PORT": str(sock.getsockname()[1]), "FORCE_TORCHRUN": "1"}}


RECORD = '{"instruction": "Say hi.", "input": "", "output": "Hi!"}'

CATALOGUE = [
    Case("yaml-syntax", "YAML syntax error", raw_yaml="stage: sft\nlearning_rate: [1\nseed: 2\n"),
    Case("yaml-not-mapping", "top level must be a mapping", raw_yaml="- a\n- b\n"),
    Case("config-file-missing", "config file not found", raw_yaml=""),
    Case("unknown-key", "unknown key 'lerning_rate' (did you mean 'learning_rate'?)", {"lerning_rate": 1e-4}),
    Case("unsupported-training-argument", "key 'torch_compile' is not supported", {"torch_compile": True}),
    Case("wrong-type", "lora_rank: expected an integer, got 'big'", {"lora_rank": "big"}),
    Case("out-of-range", "learning_rate: -1.0 is out of range", {"learning_rate": -1}),
    Case("not-a-choice", "finetuning_type: 'qlora' is not allowed", {"finetuning_type": "qlora"}),
    Case("conflicting-precision", "bf16 (true) and fp16 (true) are both set", {"bf16": True, "fp16": True}),
    Case("missing-required-key", "dataset is required", {"dataset": None}),
    Case("do-train-false", "do_train (false)", {"do_train": False}),
    Case("eval-without-split", "needs val_size > 0", {"do_eval": True}),
    Case("model-dir-missing", "model_name_or_path: folder not found", {"model_name_or_path": "./no/such/model",
                                                                     "build_tiny_model_if_missing": False}),
    Case("model-dir-without-config", "has no config.json", prepare=lambda t: (t / "m").mkdir() or
         {"model_name_or_path": str(t / "m"), "build_tiny_model_if_missing": False}),
    Case("unknown-dataset", "unknown dataset 'dmo'", {"dataset": "dmo", "dataset_dir": str(DATA)}),
    Case("dataset-info-invalid", "line 1: not valid JSON",
         prepare=lambda t: (t / "dataset_info.json").write_text("{oops") and {"dataset": "x", "dataset_dir": str(t)}),
    Case("data-file-missing", "does not exist", prepare=lambda t: (t / "dataset_info.json").write_text(
        json.dumps({"x": {"file_name": "gone.jsonl"}})) and {"dataset": "x", "dataset_dir": str(t)}),
    Case("jsonl-malformed-line", "line 2", prepare=lambda t: jsonl_dataset(t, [RECORD, "{broken", RECORD]),
         command="train"),
    Case("record-missing-columns", "output", prepare=lambda t: jsonl_dataset(t, ['{"instruction": "hi"}'])),
    Case("empty-dataset", "no records", prepare=lambda t: jsonl_dataset(t, [""]), command="train"),
    Case("all-samples-too-long", "cutoff_len", {"cutoff_len": 4}, command="train"),
    Case("unknown-template", "template", {"template": "chatmll"}),
    Case("deepspeed-invalid-json", "is not valid JSON", prepare=lambda t: ds_json(t, '{"zero_optimization": ')),
    Case("deepspeed-unknown-key", "zero_optimisation", prepare=lambda t: ds_json(t, '{"zero_optimisation": {}}')),
    Case("deepspeed-contradiction", "contradicts per_device_train_batch_size",
         prepare=lambda t: ds_json(t, '{"train_micro_batch_size_per_gpu": 7}')),
    Case("deepspeed-unknown-preset", "no such preset or file", {"deepspeed": "z9"}),
    Case("two-engines", "choose one engine", {"deepspeed": "z2", "fsdp": "full_shard"}),
    Case("fsdp-unknown-option", "fsdp: unknown option 'fast'", {"fsdp": "full_shard fast"}),
    Case("hybrid-shard-too-small", "one replica", {"fsdp": "hybrid_shard"}, env={"NPROC_PER_NODE": "2"}),
    Case("accelerate-config-mismatch", "num_processes: 2 but this launch has 4",
         {"fsdp_config": str(REPO / "examples/accelerate/fsdp_config.yaml")}, env={"NPROC_PER_NODE": "4"}),
    Case("quantization-without-gpu", "needs a CUDA GPU", {"quantization_bit": 4}),
    Case("output-dir-finished", "already holds a finished run", prepare=finished_output),
    Case("output-dir-not-creatable", "is a file", prepare=lambda t: (t / "f").write_text("x") and
         {"output_dir": str(t / "f" / "out")}),
    Case("resume-checkpoint-missing", "resume_from_checkpoint: folder not found",
         {"resume_from_checkpoint": "/no/such/checkpoint"}),
    Case("bad-launch-variable", "NPROC_PER_NODE='two' is not an integer", env={"NPROC_PER_NODE": "two"}),
    Case("node-rank-out-of-range", "NODE_RANK=3 must be in 0..1",
         env={"NNODES": "2", "NODE_RANK": "3", "MASTER_PORT": "29999"}),
    Case("multi-node-without-port", "MASTER_PORT must be set when NNODES=2", env={"NNODES": "2"}),
    Case("port-in-use", "is already in use", prepare=taken_port, command="train"),
    Case("lora-target-unknown", "lora_target: q_prj not found", {"lora_target": "q_prj"}, command="train"),
]


def write_config(tmp: Path, case: Case, tiny_model_dir: Path) -> tuple[Path, dict]:
    path = tmp / "cfg.yaml"
    if case.raw_yaml is not None:
        if case.id != "config-file-missing":
            path.write_text(case.raw_yaml)
        return path, {}
    values = {"model_name_or_path": str(tiny_model_dir), "dataset": "demo", "dataset_dir": str(DATA),
              "template": "chatml", "output_dir": str(tmp / "run"), "max_steps": 2, "cutoff_len": 128,
              **case.edit}
    env = dict(case.env)
    if case.prepare is not None:
        extra = case.prepare(tmp)
        env.update(extra.pop("__env__", {}))
        values.update(extra)
    values = {k: v for k, v in values.items() if v is not None}
    path.write_text(json.dumps(values))
    return path.with_suffix(".yaml"), env


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_bad_input_gives_one_clear_line_and_exit_2(case, tiny_model_dir, tmp_path, monkeypatch, capsys):
    path, env = write_config(tmp_path, case, tiny_model_dir)
    for name in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_PORT", "FORCE_TORCHRUN", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main([case.command, str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("shardtune: error:")]
    assert len(lines) == 1, err
    assert case.fragment in lines[0], lines[0]


def test_catalogue_is_large_enough_and_documented():
    assert len(CATALOGUE) >= 30
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Troubleshooting"):]
    missing = [c.id for c in CATALOGUE if f"`{c.id}`" not in section]
    assert not missing, f"README troubleshooting lacks: {missing}"
