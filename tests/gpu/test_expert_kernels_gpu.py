"""The experts' two ways of computing on one GPU (issue 43): transformers' grouped matmul (torch's fused grouped GEMM,
what bf16 expert weights take: model/moe.py ``experts_implementation``) against its per-expert loop (``eager``), in
bf16. The same weights and tokens give the same loss and gradients within bf16 rounding, for the MoE families the
expert-parallel tests cover; on a larger Qwen3-MoE shape each one's tokens per second is printed (the GPU tier runs
with ``-rA``, so the line reaches its log: scripts/gpu_check.sh)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from tests.gpu.helpers import BF16_RTOL, needs_gpu

pytestmark = [*needs_gpu(), pytest.mark.timeout(600)]

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe")
VOCAB = 2048
# A Qwen3-30B-A3B layer's expert shape (128 experts of 768, 8 per token) at a width of 1024, two layers.
SPEED_SHAPE = {"hidden_size": 1024, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
               "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
               "intermediate_size": 3072, "vocab_size": VOCAB}


def bf16_model(config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().train()


def loss_and_grads(model: torch.nn.Module, implementation: str, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_matmul_and_the_loop_give_the_same_loss_and_gradients(family):
    from shardtune.model.registry import tiny_registry_config

    model = bf16_model(tiny_registry_config(family, VOCAB))
    tokens = torch.randint(3, VOCAB, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    grouped_loss, grouped = loss_and_grads(model, "grouped_mm", tokens)
    loop_loss, loop = loss_and_grads(model, "eager", tokens)
    assert grouped_loss == pytest.approx(loop_loss, rel=BF16_RTOL)
    assert float((grouped - loop).norm()) <= BF16_RTOL * float(loop.norm()) * 5  # bf16 sums in another order


def test_grouped_matmul_tokens_per_second_against_the_loop():
    from transformers import AutoConfig

    model = bf16_model(AutoConfig.for_model("qwen3_moe", **SPEED_SHAPE))
    tokens = torch.randint(3, VOCAB, (8, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    speeds = {}
    for implementation in ("grouped_mm", "eager"):
        timed = copy.deepcopy(model)
        for step in range(13):  # 3 warm-up steps, then 10 measured
            if step == 3:
                torch.cuda.synchronize()
                started = time.perf_counter()
            loss_and_grads(timed, implementation, tokens)
        torch.cuda.synchronize()
        speeds[implementation] = 10 * tokens.numel() / (time.perf_counter() - started)
        del timed
    print(f"[gpu] experts of Qwen3-MoE shape {SPEED_SHAPE} on {torch.cuda.get_device_name()}, bf16, 8 x 1024 "
          f"tokens a step: grouped_mm {speeds['grouped_mm']:,.0f} tokens/s, loop {speeds['eager']:,.0f} tokens/s, "
          f"{speeds['grouped_mm'] / speeds['eager']:.2f}x")
    assert speeds["grouped_mm"] > 0 and speeds["eager"] > 0
