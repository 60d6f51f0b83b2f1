"""`shardtune train --dry-run` prints commands, world size, batch arithmetic and resolved engine settings."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import run_cli

BASE = ("train", "examples/tiny/sft_full.yaml", "--dry-run", "per_device_train_batch_size=2",
        "gradient_accumulation_steps=4")


def dry_run(*extra: str, **env: str) -> str:
    result = run_cli(*BASE, *extra, timeout=120, **env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def settings_json(text: str) -> dict:
    return json.loads(text[text.index("engine settings:\n") + len("engine settings:\n"):])


def test_single_process(tmp_path):
    out = dry_run(f"output_dir={tmp_path}/o")
    assert "runs in this process" in out and "world size: 1" in out and "= 8" in out
    assert not (tmp_path / "o").exists(), "a dry run must not write anything"


def test_two_nodes_prints_every_node_command():
    out = dry_run("output_dir=outputs/dry", NNODES="2", NODE_RANK="1", NPROC_PER_NODE="2",
                  MASTER_ADDR="10.1.2.3", MASTER_PORT="29511")
    node0 = next(line for line in out.splitlines() if line.startswith("node 0:"))
    node1 = next(line for line in out.splitlines() if line.startswith("node 1 (this node):"))
    assert "--node-rank=0" in node0 and "--node-rank=1" in node1
    assert "--master-addr=10.1.2.3 --master-port=29511" in node1
    assert "world size: 4" in out
    assert "global batch: 2 (per_device_train_batch_size) x 4 (gradient_accumulation_steps) x 4" \
           " (data-parallel size) = 32" in out
    assert "engine: ddp" in out


def test_fsdp_settings_resolved():
    out = dry_run("output_dir=outputs/dry", "fsdp=full_shard auto_wrap offload", NPROC_PER_NODE="2")
    assert "engine: fsdp2 FULL_SHARD" in out
    settings = settings_json(out)
    assert settings["offload_params"] is True and settings["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


@pytest.mark.parametrize("preset", ["z0", "z1", "z2", "z2_offload", "z3", "z3_offload"])
def test_deepspeed_json_fully_resolved(preset, tiny_model_dir):
    out = dry_run("output_dir=outputs/dry", f"model_name_or_path={tiny_model_dir}", f"deepspeed={preset}",
                  NPROC_PER_NODE="2")
    assert "engine: deepspeed" in out
    text = out[out.index("engine settings:"):]
    assert not re.search(r'"auto"', text), text
    settings = settings_json(out)
    assert settings["train_micro_batch_size_per_gpu"] == 2
    assert settings["gradient_accumulation_steps"] == 4
    assert settings["train_batch_size"] == 16
