"""The estimate under expert parallelism (estimate/expert_parallel.py; issue 43): the sharded states stay those
without it, the gathered experts and their unreduced gradients shrink to E_total/E experts per layer, and the
dispatch adds its all-to-all buffers and the combine's fp32 rows. Qwen3-30B-A3B's published config.json
(tests/fixtures/model_configs) on one node of 8 x 80 GiB, and recorded CPU runs of a small Qwen3-MoE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.cli import main
from shardtune.config.args import load_config
from shardtune.engines.plan import plan_engine
from shardtune.estimate.compare import compare_run_memory
from shardtune.estimate.config import estimate_run_memory, model_shape_for, options_for_config, workload_from_config
from shardtune.estimate.expert_parallel import (
    combine_bytes_per_token,
    dispatch_bytes,
    gathered_expert_params,
    local_experts,
)
from shardtune.estimate.hardware import GiB, Hardware
from tests.conftest import overrides_merged
from tests.distributed.test_expert_parallel_memory import MEMORY_MOE, MEMORY_RUN, TOLERANCE

REPO = Path(__file__).resolve().parents[2]
QWEN3_30B = REPO / "tests" / "fixtures" / "model_configs" / "Qwen3-30B-A3B"
LLAMA3_FULL = str(REPO / "examples" / "train_full" / "llama3_full_sft.yaml")
EIGHT_80GIB = Hardware(nodes=1, gpus_per_node=8, gpu_memory=80 * GiB, cpu_memory=2048 * GiB)
# One expert of Qwen3-30B-A3B: gate and up (2048 -> 768 each) and down (768 -> 2048).
EXPERT = 3 * 2048 * 768


def qwen3_30b(expert_parallel: int):
    """bf16 full fine-tuning of Qwen3-30B-A3B's shape (llama3_full_sft.yaml: 1 x 2048 tokens, checkpointing) under
    FSDP2 FULL_SHARD: the config, and its options on 8 x 80 GiB by name."""
    config, _ = load_config([LLAMA3_FULL, f"model_name_or_path={QWEN3_30B}", "fsdp=full_shard",
                             f"expert_parallel_size={expert_parallel}"])
    return config, {o.name: o for o in options_for_config(config, EIGHT_80GIB)}


def test_the_fixture_is_qwen3_30b_a3b_as_published():
    data = json.loads((QWEN3_30B / "config.json").read_text())
    assert (data["hidden_size"], data["num_hidden_layers"], data["num_experts"], data["num_experts_per_tok"],
            data["moe_intermediate_size"], data["num_attention_heads"], data["num_key_value_heads"],
            data["head_dim"], data["vocab_size"]) == (2048, 48, 128, 8, 768, 32, 4, 128, 151936)


def test_qwen3_30b_a3b_with_ep8_fits_with_the_gathered_experts_divided_by_8():
    config1, ep1 = qwen3_30b(1)
    config8, ep8 = qwen3_30b(8)
    shape, w1, w8 = model_shape_for(config8), workload_from_config(config1), workload_from_config(config8)
    assert w8.expert_parallel == 8 and local_experts(shape, w8) == 16 and local_experts(shape, w1) == 128
    assert gathered_expert_params(shape, w1) == 128 * EXPERT == 603_979_776
    assert gathered_expert_params(shape, w8) == 16 * EXPERT == gathered_expert_params(shape, w1) // 8
    one, eight = ep1["FSDP FULL_SHARD"], ep8["FSDP FULL_SHARD"]
    assert eight.fits and eight.available and eight.device_peak < one.device_peak
    # The shards do not change: every expert is still spread over all 8 ranks.
    for part in ("parameters", "gradients", "optimizer_states"):
        assert getattr(eight.device, part) == getattr(one.device, part)
    # Two gathered layers and one layer's unreduced gradients, in fp32: 112 of 128 experts fewer each; the
    # dispatch's four copies of 2048 tokens x top-8 x 2048 fp32 come in their place.
    dispatch = 4 * 2048 * 8 * 2048 * 4
    assert dispatch_bytes(shape, w8, 4) == dispatch == 512 * 2**20
    assert one.device.buffers - eight.device.buffers == pytest.approx(3 * 4 * 112 * EXPERT - dispatch)
    # With checkpointing one MoE layer is recomputed at a time: its combine keeps top-8 fp32 rows per token.
    assert combine_bytes_per_token(shape, w8, 0) == 8 * 2048 * 4
    assert eight.device.activations - one.device.activations == 2048 * 8 * 2048 * 4
    assert round(one.device_peak / GiB, 1) == 79.0 and round(eight.device_peak / GiB, 1) == 73.4


def test_only_fsdp2_options_that_split_experts_are_offered():
    _, ep8 = qwen3_30b(8)
    offered = {name for name, option in ep8.items() if option.available}
    assert offered == {"FSDP SHARD_GRAD_OP", "FSDP FULL_SHARD"}
    assert ep8["ZeRO-3"].note.startswith("expert_parallel_size (8) with deepspeed")
    assert "HYBRID_SHARD" in ep8["FSDP HYBRID_SHARD"].note and "offload_params" in ep8["FSDP offload"].note


def test_estimate_command_prints_the_mesh_and_experts_per_rank(capsys):
    args = [LLAMA3_FULL, f"model_name_or_path={QWEN3_30B}", "fsdp=full_shard", "--gpus-per-node", "8",
            "--gpu-memory", "80GiB", "--cpu-memory", "2TiB"]
    assert main(["estimate", *args, "expert_parallel_size=8"]) == 0
    out = capsys.readouterr().out
    assert ("expert parallel: mesh (expert-data-parallel 1 x expert-parallel 8), 16 of 128 experts per layer on each "
            "rank (FSDP2 only); a gathered layer holds 75.5M expert parameters instead of 604M (0.28 instead of 2.25 "
            "GiB in fp32); dispatch buffers 0.50 GiB per MoE layer") in out
    assert "recommended: FSDP FULL_SHARD" in out
    assert main(["estimate", *args, "expert_parallel_size=8", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["expert_parallel"]
    assert found == {"size": 8, "expert_data_parallel_size": 1, "experts_per_rank": 16,
                     "gathered_expert_bytes_per_layer": 4 * 16 * EXPERT,
                     "gathered_expert_bytes_per_layer_without": 4 * 128 * EXPERT, "dispatch_bytes": 512 * 2**20}
    assert main(["estimate", *args]) == 0
    assert "expert parallel" not in capsys.readouterr().out


@pytest.mark.parametrize(("value", "model", "message"), [
    ("3", QWEN3_30B, "expert_parallel_size (3) does not divide the world size (8)"),
    ("16", QWEN3_30B, "expert_parallel_size (16) does not divide the world size (8)"),
    ("2", REPO / "tests" / "fixtures" / "model_configs" / "Qwen3-8B", "has no mixture-of-experts layers"),
])
def test_estimate_refuses_a_split_the_run_would_refuse(value, model, message, capsys):
    assert main(["estimate", LLAMA3_FULL, f"model_name_or_path={model}", f"expert_parallel_size={value}",
                 "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--cpu-memory", "2TiB"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1



# --- recorded CPU runs: measured peak per rank against today's estimate ---

# config.json of the tiny Qwen3-MoE (arch_model_dir("qwen3_moe")): what the estimate reads of the models run.
TINY_QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
                  "intermediate_size": 172, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048,
                  "num_local_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
                  "tie_word_embeddings": False, "dtype": "float32"}
MOE_26M = {**TINY_QWEN3_MOE, "hidden_size": MEMORY_MOE["hidden"], "num_hidden_layers": MEMORY_MOE["layers"],
           "num_local_experts": MEMORY_MOE["num_experts"],
           "moe_intermediate_size": MEMORY_MOE["moe_intermediate_size"]}
PACKED_MB4 = ("packing=true", "moe_aux_loss_coef=0", "per_device_train_batch_size=4")
# Each rank's peak (train_results.json) of benchmarks/expert_parallel_memory_cpu.py's cells
# (benchmarks/results/expert-parallel-memory-cpu.md), 2026-11-29, torch 2.13 CPU, 2 shared cores: `shardtune train`
# with MEMORY_RUN (FSDP2 FULL_SHARD, full fine-tuning, 4 steps, final save) on N processes. Rank 0 is the largest
# where it gathers the whole model to save it (not estimated); the estimate's full-length rows make up for it.
# Ratios: tiny 1.127 (its 17.7 MiB of tensors are less than the 96 MiB runtime; without EP it measured 1.147);
# 26M: 0.998 (EP 1), 1.002 (EP 2), 1.036 / 1.045 (packed, EP 1 / 2), 1.079 (4 processes, EP 2 x edp 2), 1.126
# (4 processes, EP 4).
MEASURED = {
    "tiny-2-ep2": (TINY_QWEN3_MOE, 2, 2, (), [134_377_472, 131_395_584]),
    "moe26m-2-ep1": (MOE_26M, 2, 1, (), [497_598_464, 471_928_832]),
    "moe26m-2-ep2": (MOE_26M, 2, 2, (), [470_536_192, 422_002_688]),
    "moe26m-2-ep1-packed-mb4": (MOE_26M, 2, 1, PACKED_MB4, [620_122_112, 618_274_816]),
    "moe26m-2-ep2-packed-mb4": (MOE_26M, 2, 2, PACKED_MB4, [559_906_816, 604_168_192]),
    "moe26m-4-ep2": (MOE_26M, 4, 2, (), [392_470_528, 328_458_240, 348_495_872, 355_479_552]),
    "moe26m-4-ep4": (MOE_26M, 4, 4, (), [388_304_896, 298_450_944, 336_596_992, 299_663_360]),
}


def recorded_estimate(model_config: dict, nproc: int, expert_parallel: int, extra: tuple[str, ...], tmp_path: Path):
    """The estimate a recorded run printed, from its config.json and keys (the engine as the run planned it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(model_config))
    config, _ = load_config(overrides_merged([str(REPO / MEMORY_RUN[0]), *MEMORY_RUN[1:],
                                              f"model_name_or_path={tmp_path}",
                                              f"expert_parallel_size={expert_parallel}", *extra]))
    plan, _ = plan_engine(config, nproc, has_cuda=False)
    return estimate_run_memory(config, nproc, plan.kind, fsdp_settings=plan.fsdp)


@pytest.mark.parametrize("cell", sorted(MEASURED))
def test_recorded_cpu_run_is_within_15_percent_of_the_estimate(cell, tmp_path):
    model_config, nproc, expert_parallel, extra, measured = MEASURED[cell]
    found, line = compare_run_memory(recorded_estimate(model_config, nproc, expert_parallel, extra, tmp_path),
                                     measured)
    assert abs(found["memory_measured_over_estimate"] - 1) <= TOLERANCE, line


@pytest.mark.parametrize("rows", [(), PACKED_MB4], ids=["demo-rows", "packed-mb4"])
def test_ep2_lowers_the_estimate_as_it_lowered_the_measured_peak(rows, tmp_path):
    """The 26M model's experts are 95% of it: EP 2 gathers half of a layer's experts, which both the estimate and the
    measurement see (measured: the busiest rank 26 MiB and 15 MiB lower; estimated 28 and 20 MiB)."""
    suffix = "-packed-mb4" if rows else ""
    one, two = (recorded_estimate(MOE_26M, 2, ep, rows, tmp_path / str(ep)) for ep in (1, 2))
    measured_drop = max(MEASURED[f"moe26m-2-ep1{suffix}"][4]) - max(MEASURED[f"moe26m-2-ep2{suffix}"][4])
    estimated_drop = one.peak - two.peak
    assert measured_drop > 0 and estimated_drop > 0
    assert 0.5 < estimated_drop / measured_drop < 2, (estimated_drop / 2**20, measured_drop / 2**20)
