"""The catalogue of bad inputs: each gives exit code 2 and one line naming the key, file or line. No traceback.

Every case goes through the CLI entry (`shardtune <command> ...`); `train` cases must fail on the launching host,
before any rank is started. Every case id also appears in the table of docs/troubleshooting.md (checked below).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

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
    damage: Callable[[Path], object] | None = None  # spoils a copy of the tiny model, used as model_name_or_path
    argv: Callable[[Path, Path], list[str]] | None = None  # (tmp, config path) -> arguments after the command
    # Other problems the same input also has on this machine, reported in the same round (all problems at once).
    also: tuple[str, ...] = ()
    extra_yaml: str = ""  # raw lines appended to the config file (YAML as a user writes it)
    # (tmp) -> files and folders that must come out of the command exactly as they went in: nothing lost.
    keeps: Callable[[Path], list[Path]] | None = None


def jsonl_dataset(tmp: Path, lines: list[str], formatting: str = "alpaca", columns: dict | None = None) -> dict:
    (tmp / "bad.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogateescape")
    entry = {"file_name": "bad.jsonl", "formatting": formatting, **({"columns": columns} if columns else {})}
    (tmp / "dataset_info.json").write_text(json.dumps({"bad": entry}))
    return {"dataset": "bad", "dataset_dir": str(tmp)}


def json_array_dataset(tmp: Path, text: str) -> dict:
    (tmp / "bad.json").write_text(text, encoding="utf-8", errors="surrogateescape")
    (tmp / "dataset_info.json").write_text(json.dumps({"bad": {"file_name": "bad.json"}}))
    return {"dataset": "bad", "dataset_dir": str(tmp)}


def two_datasets(tmp: Path, long_prompt: str) -> dict:
    """``short`` (fits) and ``long`` (every prompt longer than cutoff_len) in one registry."""
    long_record = json.dumps({"instruction": long_prompt, "input": "", "output": "ok"})
    (tmp / "short.jsonl").write_text("\n".join([RECORD] * 4) + "\n")
    (tmp / "long.jsonl").write_text("\n".join([long_record] * 2) + "\n")
    (tmp / "dataset_info.json").write_text(json.dumps({"short": {"file_name": "short.jsonl"},
                                                      "long": {"file_name": "long.jsonl"}}))
    return {"dataset": "short,long", "dataset_dir": str(tmp)}


def ds_json(tmp: Path, text: str) -> dict:
    (tmp / "ds.json").write_text(text)
    return {"deepspeed": str(tmp / "ds.json")}


def finished_output(tmp: Path) -> dict:
    (tmp / "out").mkdir()
    (tmp / "out" / "shardtune_config.json").write_text("{}")
    (tmp / "out" / "train_results.json").write_text("{}")
    return {"output_dir": str(tmp / "out"), "overwrite_output_dir": False}


def taken_port(tmp: Path) -> dict:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    taken_port.keep = sock  # held open while the CLI runs
    return {"__env__": {"MASTER_PORT": str(sock.getsockname()[1]), "FORCE_TORCHRUN": "1"}}


def closed_port() -> int:
    """A loopback port nothing listens on: a connection there is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_yaml(tmp: Path, text: str) -> dict:
    (tmp / "acc.yaml").write_text(text)
    return {"fsdp_config": str(tmp / "acc.yaml")}


def checkpoint(tmp: Path, complete: bool = True, state: str | None = '{"global_step": 3}', step: int = 3) -> Path:
    path = tmp / "out" / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "COMPLETE").write_text("ok\n")
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    return path


def unfinished_after_finished(tmp: Path) -> Path:
    """checkpoint-3 finished, checkpoint-6 cut off while saving (no marker): resuming the latter is refused."""
    checkpoint(tmp)
    return checkpoint(tmp, complete=False, state=None, step=6)


def truncate(path: Path, keep: int = 5000) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def edit_json(path: Path, **values) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def remove_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()


def split_index(model: Path) -> None:
    """An index naming two shards, of which only the first is present."""
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


def remove_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()


def export_source(tmp: Path, weights: bytes | None = None, run_config: bool = True, base: str = "org/base") -> Path:
    """A checkpoint folder as the local/DDP engine writes it: trainable.safetensors (+ the run's config)."""
    import torch
    from safetensors.torch import save_file

    source = tmp / "checkpoint-2"
    source.mkdir()
    save_file({"w": torch.zeros(4)}, str(source / "trainable.safetensors"))
    if weights is not None:
        (source / "trainable.safetensors").write_bytes(weights)
    if run_config:
        (source / "shardtune_config.json").write_text(json.dumps({"model_name_or_path": base,
                                                                  "finetuning_type": "lora"}))
    return source


def folder_with_a_file(folder: Path) -> Path:
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's")
    return folder


def arch_model(tmp: Path, arch: str, layer_types: list[str] | None = None) -> dict:
    """A tiny model of family ``arch`` (optionally with other layer kinds in its config.json) as the run's model."""
    from shardtune.model.tiny import build_tiny_model

    model = build_tiny_model(tmp / f"tiny-{arch}", arch=arch)
    if layer_types is not None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "layer_types": layer_types}))
    return {"model_name_or_path": str(model)}


def user_folder(tmp: Path, name: str = "mine") -> Path:
    """A folder of someone's own work: what no command may delete or overwrite."""
    folder = tmp / name
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "sub" / "table.csv").write_text("a,b\n1,2\n")
    return folder


def data_copy(tmp: Path) -> Path:
    """A copy of the bundled data folder, used as dataset_dir."""
    return Path(shutil.copytree(DATA, tmp / "data"))


def model_copy(tmp: Path, tiny: Path) -> Path:
    return Path(shutil.copytree(tiny, tmp / "model"))


def run_with_checkpoint(tmp: Path, run_config: dict | None = None, step: int = 3) -> Path:
    """output ``out/`` of an earlier shardtune run with a finished ``checkpoint-<step>``."""
    path = checkpoint(tmp, step=step)
    (path.parent / "shardtune_config.json").write_text(json.dumps(run_config or {}))
    (path / "shardtune_config.json").write_text(json.dumps(run_config or {}))
    return path


def torch_checkpoint(tmp: Path, run_config: dict) -> Path:
    """A finished local/DDP checkpoint of an earlier run with ``run_config``."""
    import torch
    from safetensors.torch import save_file

    path = run_with_checkpoint(tmp, run_config)
    save_file({"w": torch.zeros(2)}, str(path / "trainable.safetensors"))
    return path


def engine_checkpoint(tmp: Path, layout: str) -> Path:
    """A finished checkpoint holding another engine's layout folder (``deepspeed``, ``fsdp_state``)."""
    path = run_with_checkpoint(tmp)
    (path / layout).mkdir()
    return path


def wider_config(tmp: Path) -> Path:
    """A model folder whose config.json has another hidden size than the tiny model's."""
    folder = tmp / "wider"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "vocab_size": 2048,
                                                     "num_hidden_layers": 2, "num_attention_heads": 4}))
    return folder


def hf_trainer_checkpoint(tmp: Path) -> dict:
    """An output folder where another trainer left checkpoint-2 (its own files, no COMPLETE marker)."""
    path = tmp / "out" / "checkpoint-2"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text('{"global_step": 2}')
    (path / "rng_state.pth").write_bytes(b"x")
    return {"output_dir": str(tmp / "out"), "overwrite_output_dir": True}


def snapshot(paths: list[Path]) -> dict[str, bytes]:
    """Every file under ``paths`` with its bytes (folders: their files), to compare before and after a command."""
    found: dict[str, bytes] = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        found.update({str(f): f.read_bytes() for f in files})
    return found


RECORD = '{"instruction": "Say hi.", "input": "", "output": "Hi!"}'
OPENAI_RECORD = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'


CATALOGUE = [
    Case("yaml-syntax", "YAML syntax error", raw_yaml="stage: sft\nlearning_rate: [1\nseed: 2\n"),
    Case("yaml-not-mapping", "top level must be a mapping", raw_yaml="- a\n- b\n"),
    Case("config-file-missing", "config file not found", raw_yaml=""),
    Case("unknown-key", "unknown key 'lerning_rate' (did you mean 'learning_rate'?)", {"lerning_rate": 1e-4}),
    Case("unsupported-training-argument", "key 'torchdynamo' is not supported", {"torchdynamo": "inductor"}),
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
    Case("attention-not-supported", "GptOssForCausalLM", {"flash_attn": "sdpa"}, command="train",
         prepare=lambda t: arch_model(t, "gpt_oss")),
    Case("attention-drops-sinks", "has attention sinks, which the flash-attn 2 kernel does not take",
         {"flash_attn": "fa2"}, command="train", prepare=lambda t: arch_model(t, "gpt_oss")),
    Case("packing-unmaskable-layers", "has chunked_attention layers", {"flash_attn": "sdpa", "packing": True},
         command="train", prepare=lambda t: arch_model(t, "gemma3", ["chunked_attention", "full_attention"])),
    Case("output-dir-finished", "already holds a finished run", prepare=finished_output),
    Case("output-dir-not-creatable", "is a file", prepare=lambda t: (t / "f").write_text("x") and
         {"output_dir": str(t / "f" / "out")}),
    Case("resume-checkpoint-missing", "resume_from_checkpoint: folder not found",
         {"resume_from_checkpoint": "/no/such/checkpoint"}),
    Case("bad-launch-variable", "NPROC_PER_NODE='two' is not an integer", env={"NPROC_PER_NODE": "two"}),
    Case("node-rank-out-of-range", "NODE_RANK=3 must be in 0..1",
         env={"NNODES": "2", "NODE_RANK": "3", "MASTER_PORT": "29999", "MASTER_ADDR": "10.0.0.1"}),
    Case("multi-node-without-port", "MASTER_PORT must be set when NNODES=2",
         env={"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}),
    Case("multi-node-without-master-addr", "MASTER_ADDR must be set when NNODES=2",
         env={"NNODES": "2", "NODE_RANK": "1", "MASTER_PORT": "29999"}),
    Case("multi-node-without-node-rank", "NODE_RANK must be set when NNODES=2",
         env={"NNODES": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29999"}),
    Case("port-in-use", "is already in use", prepare=taken_port, command="train"),
    Case("lora-target-unknown", "lora_target: q_prj not found", {"lora_target": "q_prj"}, command="train"),
    Case("lora-target-typo-found-by-check", "lora_target: q_prj not found in the model (did you mean 'q_proj'?)",
         {"lora_target": "q_prj,v_proj"}),
    # --- round two: config files and the command line ---
    Case("yaml-duplicate-key", "cfg.yaml:3: key 'learning_rate' is given twice (first on line 1)",
         raw_yaml="learning_rate: 1.0e-4\nseed: 1\nlearning_rate: 5.0e-4\n"),
    Case("config-not-yaml", "is not a .yaml/.yml/.json config file", argv=lambda t, cfg: [str(t / "cfg.txt")]),
    Case("extra-argument", "unexpected argument 'lr'", argv=lambda t, cfg: [str(cfg), "lr"]),
    Case("flag-without-value", "--learning_rate needs a value", argv=lambda t, cfg: [str(cfg), "--learning_rate"]),
    Case("output-dir-missing", "output_dir is required", {"output_dir": None}),
    Case("no-steps-or-epochs", "max_steps (0) and num_train_epochs (0.0): one must be > 0",
         {"max_steps": 0, "num_train_epochs": 0}),
    Case("quantization-needs-lora", "quantization_bit (4) needs finetuning_type: lora",
         {"quantization_bit": 4, "finetuning_type": "full"}, also=("quantization_bit (4) needs a CUDA GPU",)),
    Case("unknown-tracker", "report_to: unknown tracker(s) ['wandbb']", {"report_to": "wandbb"}),
    Case("tracker-server-unreachable", "MLFLOW_TRACKING_URI (http://127.0.0.1:", {"report_to": "mlflow"},
         prepare=lambda t: {"__env__": {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{closed_port()}"}}),
    Case("wandb-without-login", "report_to (wandb): no W&B credentials", {"report_to": "wandb"},
         env={"WANDB_MODE": "online", "WANDB_API_KEY": "", "NETRC": "/nonexistent/netrc",
              "WANDB_CONFIG_DIR": "/nonexistent/wandb"}),
    Case("hub-id-offline-not-cached", "someorg/somemodel is not in the Hugging Face cache and HF_HUB_OFFLINE=1",
         {"model_name_or_path": "someorg/somemodel", "build_tiny_model_if_missing": False},
         env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "/nonexistent/hub"}),
    Case("lora-target-all-combined", "'all' cannot be combined", {"lora_target": "all,q_proj"}),
    Case("engine-auto-with-engine", "engine (auto) with deepspeed/fsdp set", {"engine": "auto", "deepspeed": "z2"}),
    Case("dataset-dir-missing", "dataset_dir '/no/such/data' does not exist", {"dataset_dir": "/no/such/data"}),
    # --- model folders (checked on the launching host; only headers and small JSON files are read) ---
    Case("model-path-is-file", "is a file; give the model folder",
         prepare=lambda t: (t / "m.bin").write_text("x") and {"model_name_or_path": str(t / "m.bin")}),
    Case("model-config-invalid-json", "config.json line 2, column 1: not valid JSON",
         damage=lambda m: (m / "config.json").write_text('{"model_type": "llama",\n}'), command="train"),
    Case("model-config-without-model-type", "config.json has no model_type",
         damage=lambda m: (m / "config.json").write_text('{"hidden_size": 64}')),
    Case("model-weights-truncated", "model.safetensors is truncated",
         damage=lambda m: truncate(m / "model.safetensors"), command="train", env={"FORCE_TORCHRUN": "1"}),
    Case("model-weights-missing", "has no weights (model.safetensors", damage=remove_weights),
    Case("model-shard-missing", "model-00002-of-00002.safetensors is listed in model.safetensors.index.json but "
         "missing", damage=split_index),
    Case("model-tokenizer-missing", "has no tokenizer files", damage=remove_tokenizer),
    Case("model-tokenizer-invalid", "tokenizer.json line 1, column 2: not valid JSON",
         damage=lambda m: (m / "tokenizer.json").write_text("{oops")),
    Case("model-type-unknown", "model_type 'llama9' is not known to the installed transformers",
         damage=lambda m: edit_json(m / "config.json", model_type="llama9")),
    # Known to transformers, but no causal LM: every rank would fail at load (issue 29: check said ok).
    Case("model-type-not-a-decoder", "model_type 'vit' has no causal-LM class",
         damage=lambda m: edit_json(m / "config.json", model_type="vit")),
    Case("tokenizer-json-not-a-tokenizer", "tokenizer.json is not a tokenizer the tokenizers library can read",
         damage=lambda m: (m / "tokenizer.json").write_text('{"version": "1.0"}')),
    # --- engine files ---
    Case("deepspeed-duplicate-key", "has the key 'stage' twice",
         prepare=lambda t: ds_json(t, '{"zero_optimization": {"stage": 2, "stage": 3}}')),
    Case("deepspeed-not-an-object", "must hold a JSON object, not list", prepare=lambda t: ds_json(t, "[1, 2]")),
    Case("fsdp-config-missing", "fsdp_config: file not found", {"fsdp_config": "/no/such/fsdp.yaml"}),
    Case("accelerate-config-not-fsdp", "distributed_type DEEPSPEED, not FSDP",
         prepare=lambda t: accelerate_yaml(t, "distributed_type: DEEPSPEED\nnum_processes: 1\n")),
    Case("accelerate-config-duplicate-key", "acc.yaml:3: key 'num_processes' is given twice",
         prepare=lambda t: accelerate_yaml(t, "distributed_type: FSDP\nnum_processes: 1\nnum_processes: 2\n")),
    Case("accelerate-config-bad-option", "fsdp_sharding_strategy: 'X' is not allowed",
         prepare=lambda t: accelerate_yaml(t, "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: X\n")),
    # --- launch variables (read in launch/env.py, checked with their ranges before anything starts) ---
    Case("master-port-out-of-range", "MASTER_PORT=70000 is out of range; set MASTER_PORT to a whole number from 1 "
         "to 65535", env={"MASTER_PORT": "70000", "FORCE_TORCHRUN": "1"}, command="train"),
    Case("force-torchrun-not-a-flag", "FORCE_TORCHRUN='maybe' is not 1/0", env={"FORCE_TORCHRUN": "maybe"}),
    Case("nproc-per-node-zero", "NPROC_PER_NODE=0 is out of range", env={"NPROC_PER_NODE": "0"}),
    Case("min-nnodes-above-max", "MIN_NNODES (3) is above MAX_NNODES (2)", env={"MIN_NNODES": "3", "MAX_NNODES": "2"}),
    Case("rank-out-of-range", "RANK=5 is out of range", env={"RANK": "5", "WORLD_SIZE": "2"}, command="train"),
    # --- checkpoints ---
    Case("resume-not-a-checkpoint", "is not a finished checkpoint (no COMPLETE marker)",
         prepare=lambda t: (t / "plain").mkdir() or {"resume_from_checkpoint": str(t / "plain")}, command="train"),
    Case("resume-checkpoint-unfinished", "checkpoint-6 is not a finished checkpoint (no COMPLETE marker); did you "
         "mean", prepare=lambda t: {"resume_from_checkpoint": str(unfinished_after_finished(t))}),
    Case("resume-checkpoint-damaged", "trainer_state.json cannot be read",
         prepare=lambda t: {"resume_from_checkpoint": str(checkpoint(t, state="{"))}),
    Case("resume-checkpoint-is-file", "is a file; give a checkpoint-<step> folder",
         prepare=lambda t: (t / "ck").write_text("x") and {"resume_from_checkpoint": str(t / "ck")}),
    Case("auto-resume-damaged", "output_dir (resuming from", command="train",
         prepare=lambda t: checkpoint(t, state=None) and {"output_dir": str(t / "out")}),
    # --- writes: a path the run writes or deletes never reaches what it reads or what shardtune did not write ---
    Case("tokenized-path-user-folder", "mine holds files that are not tokenised datasets saved by shardtune "
         "(notes.txt, sub)", command="train",
         prepare=lambda t: {"tokenized_path": str(user_folder(t))}, keeps=lambda t: [t / "mine"]),
    Case("tokenized-path-is-data", "holds files that are not tokenised datasets", command="train",
         prepare=lambda t: {"dataset_dir": str(data_copy(t)), "tokenized_path": str(t / "data")},
         keeps=lambda t: [t / "data"]),
    Case("tokenized-path-contains-output", "tok) contains output_dir (", command="train",
         prepare=lambda t: {"tokenized_path": str(t / "tok"), "output_dir": str(t / "tok" / "run")}),
    Case("overwrite-deletes-resume-checkpoint", "overwrite_output_dir (true) would delete", command="train",
         prepare=lambda t: {"output_dir": str(t / "out"), "overwrite_output_dir": True,
                            "resume_from_checkpoint": str(run_with_checkpoint(t))},
         keeps=lambda t: [t / "out"]),
    Case("output-dir-is-model", "model) is model_name_or_path: the run would write", command="train",
         damage=lambda m: None, prepare=lambda t: {"output_dir": str(t / "model"), "overwrite_output_dir": True},
         keeps=lambda t: [t / "model"]),
    Case("output-dir-is-data", "data) is dataset_dir: the run would write", command="train",
         prepare=lambda t: {"dataset_dir": str(data_copy(t)), "output_dir": str(t / "data"),
                            "overwrite_output_dir": True}, keeps=lambda t: [t / "data"]),
    Case("output-dir-is-adapter", "adapter) is adapter_name_or_path: the run would write", command="train",
         prepare=lambda t: (user_folder(t, "adapter") / "adapter_config.json").write_text("{}") and
         {"adapter_name_or_path": str(t / "adapter"), "output_dir": str(t / "adapter")},
         keeps=lambda t: [t / "adapter"]),
    Case("output-dir-someone-elses", "holds files shardtune did not write (notes.txt, sub)", command="train",
         prepare=lambda t: {"output_dir": str(user_folder(t))}, keeps=lambda t: [t / "mine"]),
    Case("output-dir-other-trainer-checkpoint", "checkpoint-2, which shardtune did not write", command="train",
         prepare=hf_trainer_checkpoint, keeps=lambda t: [t / "out"]),
    Case("make-tiny-model-over-folder", "mine is not empty (notes.txt, sub)", command="make-tiny-model",
         argv=lambda t, cfg: ["--out", str(user_folder(t))], keeps=lambda t: [t / "mine"]),
    Case("slurm-script-over-file", "notes.txt exists and was not written by shardtune", command="slurm",
         argv=lambda t, cfg: [str(cfg), "--nodes", "1", "--gpus-per-node", "0", "--script",
                              str(user_folder(t) / "notes.txt")], keeps=lambda t: [t / "mine"]),
    Case("k8s-manifest-over-file", "notes.txt exists and was not written by shardtune", command="k8s",
         argv=lambda t, cfg: [str(cfg), "--nodes", "2", "--gpus-per-node", "1", "--image", "img:1", "--out",
                              str(user_folder(t) / "notes.txt")], keeps=lambda t: [t / "mine"]),
    Case("convert-config-over-itself", "--out names the file being converted", command="convert-config",
         argv=lambda t, cfg: [str(cfg), "--out", str(cfg)], keeps=lambda t: [t / "cfg.yaml"]),
    # --- numbers and spellings: nothing nonsensical or ambiguous is accepted silently ---
    Case("not-a-finite-number", "weight_decay: nan is not a finite number", {"weight_decay": float("nan")}),
    Case("seed-negative", "seed: -1 is out of range; it must be >= 0", {"seed": -1}),
    Case("freeze-no-layers", "freeze_trainable_layers (0) selects no layer",
         {"finetuning_type": "freeze", "freeze_trainable_layers": 0}),
    Case("warmup-longer-than-run", "warmup_steps (10) is not below max_steps (2)", {"warmup_steps": 10}),
    Case("warmup-ratio-whole-run", "warmup_ratio (1.0) warms up over the whole run", {"warmup_ratio": 1.0}),
    Case("key-twice-on-command-line", "command line: learning_rate is given twice ('1e-4' and '2e-4')",
         argv=lambda t, cfg: [str(cfg), "learning_rate=1e-4", "--learning_rate", "2e-4"]),
    Case("key-in-two-spellings-on-command-line", "contradicts 'eval_strategy' ('steps')", {"val_size": 0.1},
         argv=lambda t, cfg: [str(cfg), "eval_strategy=steps", "evaluation_strategy=no"]),
    Case("dataset-registered-twice", "dataset_info.json lines 1 and 2: 'x' is given twice",
         prepare=lambda t: (t / "dataset_info.json").write_text(
             '{"x": {"file_name": "a.jsonl"},\n "x": {"file_name": "b.jsonl"}}') and
         {"dataset": "x", "dataset_dir": str(t)}),
    Case("dataset-listed-twice", "dataset: 'demo' is listed twice", {"dataset": "demo,demo"}),
    Case("lookalike-key", "U+0435 CYRILLIC SMALL LETTER IE at position 2; did you mean 'learning_rate'?",
         {"l\u0435arning_rate": 1e-4}),
    Case("lookalike-template", "U+0441 CYRILLIC SMALL LETTER ES at position 1) (did you mean 'chatml'?)",
         {"template": "\u0441hatml"}),
    Case("invisible-character-in-path", "U+200B ZERO WIDTH SPACE", command="train",
         prepare=lambda t: {"model_name_or_path": str(t / "model") + "\u200b"}, damage=lambda m: None),
    Case("unset-variable-in-path", "output_dir: '$SHARDTUNE_NO_SUCH_VAR/run' uses $SHARDTUNE_NO_SUCH_VAR, which is "
         "not set", {"output_dir": "$SHARDTUNE_NO_SUCH_VAR/run"}),
    # --- messages point at the line, the record, the real cause ---
    Case("yaml-value-at-its-line", "cfg.yaml:8: lora_rank: expected an integer, got 'big'",
         extra_yaml="lora_rank: big\n"),
    Case("config-is-a-folder", "is a folder; give the config file",
         argv=lambda t, cfg: [str((t / "conf.yaml").mkdir() or t / "conf.yaml")]),
    Case("dataset-info-is-a-folder", "dataset_info.json is a folder",
         prepare=lambda t: (t / "dataset_info.json").mkdir() or {"dataset": "x", "dataset_dir": str(t)}),
    Case("deepspeed-is-a-folder", "examples/deepspeed is a folder; give its JSON file",
         prepare=lambda t: {"deepspeed": str(REPO / "examples/deepspeed")}),
    Case("fsdp-config-is-a-folder", "examples/accelerate is a folder; give the FSDP or accelerate config file",
         prepare=lambda t: {"fsdp_config": str(REPO / "examples/accelerate")}),
    Case("jsonl-invalid-utf8", "bad.jsonl line 2: not valid UTF-8 (byte 0xff", command="train",
         prepare=lambda t: jsonl_dataset(t, [RECORD, '{"instruction": "caf\udcff", "input": "", "output": "x"}',
                                             RECORD])),
    Case("json-array-record-not-an-object", "bad.json record 2 (line 3): expected a JSON object", command="train",
         prepare=lambda t: json_array_dataset(t, f"[{RECORD},\n\n\"oops\"]")),
    Case("json-array-record-missing-column", "bad.json record 2 (line 2): 'output' is missing", command="train",
         prepare=lambda t: json_array_dataset(t, f'[{RECORD},\n{{"instruction": "hi", "input": ""}}]')),
    Case("dataset-entry-columns-not-a-mapping", "dataset 'x': 'columns' must be an object", prepare=lambda t: (
        t / "dataset_info.json").write_text('{"x": {"file_name": "a.jsonl", "columns": "messages"}}') and
        (t / "a.jsonl").write_text(RECORD) and {"dataset": "x", "dataset_dir": str(t)}),
    Case("fsdp-options-contradict", "fsdp (full_shard offload) and fsdp_config fsdp_offload_params (False) "
         "contradict each other", {"fsdp": "full_shard offload", "fsdp_config": {"fsdp_offload_params": False}}),
    Case("cutoff-drops-one-dataset", "dataset 'long': cutoff_len (128) is too small for every one of its 2 samples",
         command="train", prepare=lambda t: two_datasets(t, long_prompt=" ".join(["word"] * 300))),
    # --- resume: the checkpoint must be one this run can read back (checked before launch, not in the ranks) ---
    Case("resume-other-lora-rank", "was trained with other settings (lora_rank 8 then, 16 now)", {"lora_rank": 16},
         command="train", prepare=lambda t: {"resume_from_checkpoint": str(torch_checkpoint(
             t, {"finetuning_type": "lora", "lora_rank": 8}))}),
    Case("resume-other-engine", "holds a deepspeed checkpoint (deepspeed), and this run uses local", command="train",
         prepare=lambda t: {"resume_from_checkpoint": str(engine_checkpoint(t, "deepspeed"))}),
    Case("resume-other-model", "the model's hidden_size 128 then", command="train",
         prepare=lambda t: {"resume_from_checkpoint": str(torch_checkpoint(
             t, {"model_name_or_path": str(wider_config(t)), "finetuning_type": "lora"}))}),
    Case("estimate-model-config-zero", "hidden_size (0) must be a whole number of at least 1", command="estimate",
         damage=lambda m: edit_json(m / "config.json", hidden_size=0),
         argv=lambda t, cfg: [str(cfg), "--gpu-memory", "80GiB"]),
    # --- sequence parallelism: what the split cannot run is refused before launch (engines/sequence_parallel_plan) ---
    Case("sequence-parallel-two-spellings", "'cp_size' (2) contradicts 'sequence_parallel_size' (4)",
         {"cp_size": 2, "sequence_parallel_size": 4}, env={"NPROC_PER_NODE": "4"}),
    Case("sequence-parallel-deepspeed-disagrees", "sequence_parallel_size (2) in ", {"sequence_parallel_size": 4},
         env={"NPROC_PER_NODE": "4"}, prepare=lambda t: ds_json(t, '{"sequence_parallel_size": 2}')),
    Case("sequence-parallel-world-size", "sequence_parallel_size (2) does not divide the world size (3)",
         {"sequence_parallel_size": 2}, env={"NPROC_PER_NODE": "3"}),
    Case("sequence-parallel-flash", "with sequence_parallel_size (2): the split attention runs sdpa's flash kernel, "
         "which needs a CUDA GPU", {"sequence_parallel_size": 2, "flash_attn": "fa2"}, env={"NPROC_PER_NODE": "2"},
         command="train"),
    Case("sequence-parallel-ulysses-heads", "sequence_parallel_mode (ulysses): ", {
        "sequence_parallel_size": 4, "sequence_parallel_mode": "ulysses"}, env={"NPROC_PER_NODE": "4"}),
    Case("sequence-parallel-stateful-layers", "has linear_attention layers, whose state runs along the whole "
         "sequence", {"sequence_parallel_size": 2}, env={"NPROC_PER_NODE": "2"},
         damage=lambda m: edit_json(m / "config.json", layer_types=["linear_attention", "full_attention"])),
    Case("sequence-parallel-predict", "do_predict (true) with sequence_parallel_size (2)", {
        "sequence_parallel_size": 2, "do_predict": True, "predict_with_generate": True, "eval_dataset": "demo"},
         env={"NPROC_PER_NODE": "2"}),
    Case("sequence-parallel-cutoff-len", "cutoff_len (3) is below sequence_parallel_size (4)",
         {"sequence_parallel_size": 4, "cutoff_len": 3}, env={"NPROC_PER_NODE": "4"}),
    # --- the other commands ---
    Case("export-source-missing", "export: folder not found: /no/such/run", command="export",
         argv=lambda t, cfg: ["/no/such/run", "--out", str(t / "x")]),
    Case("export-unknown-layout", "holds no checkpoint shardtune knows", command="export",
         argv=lambda t, cfg: [str(t), "--out", str(t / "x")]),
    Case("export-checkpoint-truncated", "trainable.safetensors is truncated", command="export",
         argv=lambda t, cfg: [str(export_source(t, weights=b"\x10")), "--out", str(t / "x")]),
    Case("export-base-model-damaged", "export: base model: ", command="export", damage=remove_weights,
         argv=lambda t, cfg: [str(export_source(t, base=str(t / "model"))), "--out", str(t / "x")]),
    Case("export-out-is-source", "is the source", command="export",
         argv=lambda t, cfg: [str(export_source(t)), "--out", str(t / "checkpoint-2")]),
    Case("export-out-not-an-export", "not an earlier export", command="export",
         argv=lambda t, cfg: [str(export_source(t)), "--out", str(folder_with_a_file(t / "mine"))]),
    Case("export-lora-without-run-config", "--finetuning-type lora needs the run's shardtune_config.json",
         command="export", argv=lambda t, cfg: [str(export_source(t, run_config=False)), "--out", str(t / "x"),
                                                "--model", str(t), "--finetuning-type", "lora"]),
    Case("estimate-bad-gpu-count", "--gpus-per-node (two)", command="estimate",
         argv=lambda t, cfg: [str(cfg), "--gpus-per-node", "two"]),
    Case("estimate-model-config-invalid", "config.json line 1, column 2: not valid JSON", command="estimate",
         damage=lambda m: (m / "config.json").write_text("{")),
    Case("estimate-model-config-missing", "--model-config (/no/such/config.json)", command="estimate",
         argv=lambda t, cfg: [str(cfg), "--model-config", "/no/such/config.json"]),
    # --- messages that name the right thing: a URL for a path, a file for a folder, a command typo, a format ---
    Case("path-is-url", "output_dir: 's3://bucket/run' is a URL; shardtune reads local paths: download it first",
         {"output_dir": "s3://bucket/run"}),
    Case("adapter-path-is-file", "is a file; give the adapter folder",
         prepare=lambda t: (t / "a.txt").write_text("x") and {"adapter_name_or_path": str(t / "a.txt")}),
    Case("command-typo", "unknown command 'trian' (did you mean 'train'?)", command="trian"),
    Case("records-of-another-format", 'these look like openai records: set "formatting": "openai"',
         prepare=lambda t: jsonl_dataset(t, [OPENAI_RECORD], formatting="sharegpt")),
    Case("turns-of-another-format", '"tags": {"role_tag": "role", "content_tag": "content"',
         prepare=lambda t: jsonl_dataset(t, [OPENAI_RECORD], formatting="sharegpt", columns={"messages": "messages"})),
]


def write_config(tmp: Path, case: Case, tiny_model_dir: Path) -> tuple[Path, dict]:
    path = tmp / "cfg.yaml"
    if case.raw_yaml is not None:
        if case.id != "config-file-missing":
            path.write_text(case.raw_yaml)
        return path, {}
    model = tiny_model_dir
    if case.damage is not None:
        model = Path(shutil.copytree(tiny_model_dir, tmp / "model"))
        case.damage(model)
    values = {"model_name_or_path": str(model), "dataset": "demo", "dataset_dir": str(DATA),
              "template": "chatml", "output_dir": str(tmp / "run"), "max_steps": 2, "cutoff_len": 128,
              **case.edit}
    env = dict(case.env)
    if case.prepare is not None:
        extra = case.prepare(tmp)
        env.update(extra.pop("__env__", {}))
        values.update(extra)
    values = {k: v for k, v in values.items() if v is not None}
    path.write_text(yaml.safe_dump(values, sort_keys=False, allow_unicode=True) + case.extra_yaml)
    return path, env


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_bad_input_gives_one_clear_line_and_exit_2(case, tiny_model_dir, tmp_path, monkeypatch, capsys):
    path, env = write_config(tmp_path, case, tiny_model_dir)
    for name in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_PORT", "MASTER_ADDR", "FORCE_TORCHRUN", "RANK",
                 "WORLD_SIZE", "RDZV_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = case.argv(tmp_path, path) if case.argv is not None else [str(path)]
    kept = snapshot(case.keeps(tmp_path)) if case.keeps is not None else {}
    code = main([case.command, *args])
    out, err = capsys.readouterr()
    assert code == 2, err
    if case.keeps is not None:
        assert snapshot(case.keeps(tmp_path)) == kept, "the command changed or deleted files it must keep"
        assert kept, "the case must keep something"
    assert "[shardtune] launching" not in out, "the mistake must be found before any rank starts"
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("shardtune: error:")]
    also_here = [f for f in case.also if not (f.endswith("needs a CUDA GPU") and torch_sees_cuda())]
    assert len(lines) == 1 + len(also_here), err
    assert case.fragment in lines[0], lines[0]
    for fragment in also_here:
        assert any(fragment in line for line in lines[1:]), err


def torch_sees_cuda() -> bool:
    from shardtune.host import visible_gpu_count

    return visible_gpu_count() > 0


def test_catalogue_is_large_enough_and_documented():
    assert len(CATALOGUE) >= 60
    assert len({c.id for c in CATALOGUE}) == len(CATALOGUE), "case ids must be unique"
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", page, flags=re.MULTILINE)
    assert sorted(rows) == sorted(c.id for c in CATALOGUE), \
        "docs/troubleshooting.md's table rows and CATALOGUE must list the same cases"


def test_launch_and_config_problems_are_reported_in_one_round(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A bad launch variable does not hide the config's problems: both come out of one run, before any rank."""
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    truncate(model / "model.safetensors")
    path, _ = write_config(tmp_path, Case("x", "", {"model_name_or_path": str(model)}), tiny_model_dir)
    monkeypatch.setenv("MASTER_PORT", "70000")
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    assert main(["train", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("shardtune: error:")]
    assert len(lines) == 2, err
    assert "MASTER_PORT=70000 is out of range" in lines[0] and "model.safetensors is truncated" in lines[1]
    assert "[shardtune] launching" not in out


def test_yaml_merge_keys_and_nested_duplicates(tmp_path):
    """`<<: *base` then overriding a key is YAML's own reuse, not a repetition; a repeated nested key is refused."""
    from shardtune.config.load import load_yaml_file
    from shardtune.errors import ConfigError

    (tmp_path / "ok.yaml").write_text("base: &b\n  x: 1\nuse:\n  <<: *b\n  x: 2\n")
    assert load_yaml_file(tmp_path / "ok.yaml")["use"] == {"x": 2}
    (tmp_path / "bad.yaml").write_text("a:\n  x: 1\n  x: 2\nb: 1\nb: 2\n")
    with pytest.raises(ConfigError) as err:
        load_yaml_file(tmp_path / "bad.yaml")
    assert [p.split(": key")[0] for p in err.value.problems] == [f"{tmp_path / 'bad.yaml'}:3",
                                                                 f"{tmp_path / 'bad.yaml'}:5"]
