"""async_save's host memory in the estimate: one staged copy of what each rank writes in a checkpoint, counted in
the node's CPU memory only when async_save is on, and the checkpoint bytes per node the cluster commands size the
scheduler's warning with. No torch import."""

from __future__ import annotations

import json

import pytest

from shardtune.config.args import load_config
from shardtune.estimate import Hardware, Workload, build_options, estimate_command, recommend
from shardtune.estimate.config import configured_option, hardware_for
from shardtune.estimate.parts import CPU_RUNTIME_BYTES, CheckpointShare
from shardtune.estimate.report import Estimate, estimate_dict, render_table
from shardtune.estimate.shape import shape_from_config
from tests.conftest import REPO

GiB = 1024**3
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 172, "vocab_size": 2048, "tie_word_embeddings": False}
SHAPE = shape_from_config(TINY_CONFIG)
P = SHAPE.total_params
TINY_LORA = str(REPO / "examples" / "tiny" / "sft_lora.yaml")


def options(async_save: bool, nodes: int = 2, per_node: int = 2, **workload) -> dict:
    """Full bf16 fine-tuning with AdamW (8 state bytes per parameter) on nodes x per_node GPUs."""
    w = Workload(micro_batch=1, seq_len=128, precision="bf16", async_save=async_save, **workload)
    hw = Hardware(nodes=nodes, gpus_per_node=per_node, gpu_memory=80 * GiB, cpu_memory=512 * GiB)
    return {o.name: o for o in build_options(SHAPE, w, hw)}


@pytest.fixture
def tiny_model(tmp_path):
    """Only config.json: the estimate never reads weights."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path


def test_no_staging_without_async_save():
    off, on = options(async_save=False), options(async_save=True)
    for name, option in off.items():
        assert option.staging_per_node == 0
        assert option.checkpoint_per_node > 0  # what a checkpoint writes is known either way (the signal time)
        assert on[name].staging_per_node == on[name].checkpoint_per_node == option.checkpoint_per_node
        assert on[name].cpu_per_node >= option.cpu_per_node


def test_ddp_rank0_holds_it_all_zero3_ranks_a_quarter():
    """4 ranks, 2 per node. DDP: rank 0 writes fp32 weights + Adam's 8 bytes = 12 bytes per parameter, the others
    nothing; ZeRO-3: every rank its quarter of DeepSpeed's fp32 master + states (K = 12)."""
    o = options(async_save=True)
    assert o["DDP"].checkpoint == CheckpointShare(12 * P, 0)
    assert o["DDP"].staging_per_node == 12 * P  # the node with rank 0
    assert o["ZeRO-3"].checkpoint == CheckpointShare(3 * P, 3 * P)
    assert o["ZeRO-3"].staging_per_node == 2 * 3 * P
    assert o["ZeRO-3"].checkpoint.first_rank * 4 == o["DDP"].checkpoint.first_rank
    assert o["FSDP FULL_SHARD"].checkpoint == CheckpointShare.even((4 + 8) * P / 4)
    assert o["FSDP HYBRID_SHARD"].checkpoint == CheckpointShare.even((4 + 8) * P / 2)  # sharded within a node
    # Below ZeRO-3 rank 0 also writes the bf16 module.
    assert o["ZeRO-2"].checkpoint == CheckpointShare(2 * P + 3 * P, 3 * P)
    # One process: it holds everything.
    assert options(async_save=True, nodes=1, per_node=1)["DDP"].staging_per_node == 12 * P


def test_staging_is_counted_in_the_node_memory():
    """ZeRO-3+offload keeps its states in host memory, so the node's training memory (more than its loading)
    grows by exactly the staged copy."""
    off, on = options(async_save=False)["ZeRO-3+offload"], options(async_save=True)["ZeRO-3+offload"]
    assert on.staging_per_node == 6 * P
    assert on.cpu_per_node == pytest.approx(off.cpu_per_node + 6 * P)
    assert on.cpu_per_node > on.setup_cpu_per_node + 2 * CPU_RUNTIME_BYTES


def test_lora_checkpoints_leave_the_frozen_base_out_under_ddp_and_deepspeed():
    o = options(async_save=True, finetuning_type="lora", lora_rank=8)
    t = o["DDP"].checkpoint.first_rank / 12  # fp32 adapters + Adam
    assert 0 < t < P / 10
    assert o["ZeRO-3"].checkpoint.first_rank == pytest.approx(12 * t / 4)
    assert o["ZeRO-2"].checkpoint.first_rank == pytest.approx(2 * t + 12 * t / 4)


def test_report_shows_the_staging_line_and_column():
    hardware = Hardware(nodes=2, gpus_per_node=2, gpu_memory=80 * GiB, cpu_memory=512 * GiB)
    for async_save in (False, True):
        workload = Workload(micro_batch=1, seq_len=128, precision="bf16", async_save=async_save)
        found = build_options(SHAPE, workload, hardware)
        estimate = Estimate(SHAPE, workload, hardware, found, recommend(found, hardware, workload))
        text = render_table(estimate)
        header = next(line for line in text.splitlines() if line.startswith("option")).split()
        assert ("staging" in header) == async_save == ("async_save staging (host)" in text)
    assert header.index("staging") == header.index("CPU/node") - 1
    ddp = next(line for line in text.splitlines() if line.startswith("DDP ")).split()
    assert ddp[-3] == f"{12 * P / GiB:.2f}"  # staging, CPU/node, fits
    assert "async_save staging (host): each rank holds one copy" in text
    assert f"DDP {12 * P / GiB:.2f} on rank 0, 0.0 on the others; ZeRO-1" in text
    assert f"ZeRO-3 {3 * P / GiB:.2f};" in text
    data = estimate_dict(estimate)["options"][0]
    assert data["async_save_staging_bytes_per_node"] == data["checkpoint_bytes_per_node"] == \
        data["checkpoint_bytes_first_rank"] == 12 * P
    assert data["checkpoint_bytes_other_rank"] == 0


def test_configured_run_counts_staging_from_its_config(tiny_model):
    """The key reaches the estimate a run's memory request is sized from (launch/node_resources.py)."""
    hardware = hardware_for(4, 2, 80 * GiB, 512 * GiB)
    config, _ = load_config([TINY_LORA, f"model_name_or_path={tiny_model}", "deepspeed=z3", "async_save=true"])
    option = configured_option(config, hardware)
    assert option.name == "ZeRO-3" and option.staging_per_node == option.checkpoint_per_node > 0
    plain, _ = load_config([TINY_LORA, f"model_name_or_path={tiny_model}", "deepspeed=z3"])
    assert configured_option(plain, hardware).staging_per_node == 0


def test_estimate_command_shows_staging_for_an_async_save_config(tiny_model, capsys):
    argv = [TINY_LORA, f"model_name_or_path={tiny_model}", "--gpus-per-node", "2", "--gpu-memory", "24GB",
            "--cpu-memory=64GiB"]
    assert estimate_command(argv) == 0
    assert "async_save staging (host)" not in capsys.readouterr().out
    assert estimate_command([*argv, "async_save=true"]) == 0
    out = capsys.readouterr().out
    assert "async_save staging (host): each rank holds one copy" in out
    assert "DDP 0.00 on rank 0, 0.0 on the others" in out  # a tiny LoRA: a few KB on rank 0
