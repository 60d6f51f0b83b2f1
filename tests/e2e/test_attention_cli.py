"""The real CLI picks an attention kernel per model: GPT-OSS (no sdpa, attention sinks) trains with the defaults
on 2 processes with packed rows, the run log says which kernel and why once, and the outputs record it."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_gpt_oss_trains_with_the_kernel_auto_picks(arch_model_dir, tmp_path):
    # moe_aux_loss_coef=0: transformers' router aux loss cannot take the per-layer-type masks of packed rows (refused)
    out = tmp_path / "run"
    result = run_cli("train", "model_name_or_path=" + str(arch_model_dir("gpt_oss")), "dataset=demo",
                     f"dataset_dir={REPO / 'data'}", "template=gpt_oss", f"output_dir={out}", "max_steps=2",
                     "cutoff_len=512", "packing=true", "moe_aux_loss_coef=0", "finetuning_type=lora",
                     "per_device_train_batch_size=1",
                     NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("[shardtune] attention:")]
    assert lines == ["[shardtune] attention: eager (auto: GptOssForCausalLM does not support sdpa; flash-attn 2 "
                     "would drop its attention sinks)"]
    results = json.loads((out / "train_results.json").read_text())
    assert results["attn_implementation"] == "eager" and results["world_size"] == 2
    assert json.loads((out / "shardtune_config.json").read_text())["attn_implementation"] == "eager"


def test_packed_sft_under_varlen_equals_the_dense_block_mask(tiny_model_dir, tmp_path):
    """attn_implementation: varlen (sequence offsets, no [B, 1, L, L] mask; SDPA per sample on the CPU) trains 2
    processes on packed rows with the losses and gradient norms of the dense block mask under sdpa."""
    runs = {}
    for kernel in ("varlen", "sdpa"):
        out = tmp_path / kernel
        result = run_cli("train", "examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}",
                         f"output_dir={out}", f"attn_implementation={kernel}", "packing=true", "cutoff_len=256",
                         "max_steps=3", "logging_steps=1", "save_strategy=no", "do_eval=false", "eval_strategy=no",
                         "val_size=0", "plot_loss=false", "per_device_train_batch_size=2", NPROC_PER_NODE="2")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"[shardtune] attention: {kernel} (asked for" in result.stdout
        log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if line.strip()]
        runs[kernel] = [(r["loss"], r["grad_norm"]) for r in log if "loss" in r]
    assert len(runs["varlen"]) == 3
    for (loss, norm), (dense_loss, dense_norm) in zip(runs["varlen"], runs["sdpa"], strict=True):
        assert loss == pytest.approx(dense_loss, rel=1e-5) and norm == pytest.approx(dense_norm, rel=1e-4)
