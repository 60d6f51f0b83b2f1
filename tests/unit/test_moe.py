"""Mixture-of-experts training on one process: the router's auxiliary loss as transformers adds it, and which
weights LoRA's ``all`` adapts in each MoE family (tiny models of model/architectures.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardtune.config.load import build_config
from shardtune.engines.base import PrecisionSettings
from shardtune.engines.local import LocalEngine
from shardtune.errors import ConfigError
from shardtune.model import moe
from shardtune.model.finetuning.adapter import apply_adapter
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.finetuning.targets import LoraTargets, lora_targets
from shardtune.optim.build import OptimizerSettings, build_optimizer, build_scheduler
from shardtune.train.loop import train_step

MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
COEF = 0.5  # large, so a missing or mis-scaled aux term shows far beyond rounding


def load(arch_model_dir, name: str) -> torch.nn.Module:
    extra = {"attn_implementation": "eager"} if name == "gpt_oss" else {}
    return AutoModelForCausalLM.from_pretrained(arch_model_dir(name), **extra)


def batch(seed: int, rows: int = 3, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # padding: transformers' aux loss leaves it out through the attention mask
    labels = ids.clone()
    labels[:, :4] = -100
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def engine_for(model: torch.nn.Module) -> LocalEngine:
    engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
    engine.prepare(model, lambda p: build_optimizer(p, OptimizerSettings(optim="sgd", learning_rate=0.1)),
                   lambda o: build_scheduler(o, "constant", 10, 0))
    return engine


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_step_loss_and_update_equal_transformers_own_loss_with_aux(name, arch_model_dir):
    model = load(arch_model_dir, name)
    model.config.router_aux_loss_coef = COEF
    reference = copy.deepcopy(model)
    reference.router_aux_loss_coef = COEF  # read from the config at init: transformers adds COEF x aux_loss
    data = batch(0)
    out = reference(**data, output_router_logits=True, use_cache=False)
    assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0
    out.loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    coef = moe.router_aux_loss_coef(model.config, None)
    assert coef == COEF
    metrics = train_step(engine_for(model), [data], 0.0, router_aux_loss_coef=coef)
    assert metrics["loss"] == pytest.approx(float(out.loss), rel=1e-5)
    assert metrics["aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
    lm_only = float(out.loss) - COEF * float(out.aux_loss)
    assert abs(metrics["loss"] - lm_only) > 1e-2  # the aux term really is in the loss
    for (key, trained), expected in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(trained, expected, rtol=1e-4, atol=1e-6, msg=key)


def test_accumulation_averages_the_aux_loss_over_micro_batches(arch_model_dir):
    """Two micro-batches: the LM loss is one token mean over both, the aux term the mean of each one's aux loss
    (what transformers' per-micro-batch loss gives when the Trainer averages micro-batches of equal tokens)."""
    model = load(arch_model_dir, "qwen3_moe")
    first, second = batch(1), batch(2, rows=2, length=9)
    tokens, lm_sum, aux = [], 0.0, []
    with torch.no_grad():
        for b in (first, second):
            out = model(**b, output_router_logits=True, use_cache=False)
            n = int((b["labels"][:, 1:] != -100).sum())
            tokens.append(n)
            aux.append(float(out.aux_loss))
            lm_sum += (float(out.loss) - model.router_aux_loss_coef * aux[-1]) * n
    metrics = train_step(engine_for(model), [first, second], 0.0, router_aux_loss_coef=COEF)
    assert metrics["aux_loss"] == pytest.approx(sum(aux) / 2, rel=1e-5)
    assert metrics["loss"] == pytest.approx(lm_sum / sum(tokens) + COEF * sum(aux) / 2, rel=1e-5)


def test_moe_aux_loss_coef_overrides_and_zero_turns_it_off(arch_model_dir):
    config = load(arch_model_dir, "qwen3_moe").config
    assert moe.router_aux_loss_coef(config, None) == config.router_aux_loss_coef
    assert moe.router_aux_loss_coef(config, 0.3) == 0.3
    assert moe.router_aux_loss_coef(config, 0.0) is None
    assert build_config({"moe_aux_loss_coef": 0.3}).moe_aux_loss_coef == 0.3
    # DeepSeek-V3 balances experts with a routing bias: no auxiliary loss to add, and a dense model has none
    assert moe.router_aux_loss_coef(load(arch_model_dir, "deepseek_v3").config, 0.3) is None
    assert moe.router_aux_loss_coef(load(arch_model_dir, "llama").config, 0.3) is None


# --- which weights LoRA adapts ---

EXPECTED_ALL = {
    "qwen3_moe": ["k_proj", "o_proj", "q_proj", "v_proj"],
    "mixtral": ["k_proj", "o_proj", "q_proj", "v_proj"],
    "gpt_oss": ["k_proj", "o_proj", "q_proj", "v_proj"],
    # the dense first layer and the shared experts are Linear layers; latent attention's projections too
    "deepseek_v3": ["down_proj", "gate_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj",
                    "up_proj"],
}
FUSED = ["experts.down_proj", "experts.gate_up_proj"]


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_lora_all_on_moe_adapts_attention_and_fused_experts_never_the_router(name, arch_model_dir, capsys):
    model = load(arch_model_dir, name)
    blocks = list(moe.sparse_moe_blocks(model))
    assert blocks and all(moe.EXPERTS_NAME in dict(b.named_children()) for _, b in blocks)
    assert moe.fused_expert_parameters(model)  # 3-D expert weights in transformers 5.23
    assert lora_targets(model, ("all",)) == LoraTargets(EXPECTED_ALL[name], FUSED)
    assert "fused expert weights down_proj,gate_up_proj; routers" in capsys.readouterr().out
    wrapped = apply_adapter(model, FinetuningSettings(lora_target=("all",), lora_rank=4))
    adapted = {n for n, _ in wrapped.named_parameters() if ".lora_A." in n}
    assert any(".self_attn." in n for n in adapted)
    assert not any(".gate." in n or ".router." in n for n in adapted)
    experts = {n.split(".lora_A.")[0] for n in adapted if ".mlp.experts" in n}
    assert len(experts) == 2 * len(blocks)  # gate_up_proj and down_proj of every sparse block
    routers = [p for n, p in wrapped.named_parameters() if n.endswith((".gate.weight", ".router.weight"))]
    assert routers and not any(p.requires_grad for p in routers)
    frozen_experts = [p for n, p in wrapped.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
    assert frozen_experts and not any(p.requires_grad for p in frozen_experts)
    ids = torch.randint(5, 200, (2, 10))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in wrapped.named_parameters() if ".mlp.experts" in n and ".lora_B." in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    if name == "deepseek_v3":
        # peft 0.21 maps gate_proj/up_proj/down_proj to the fused experts: the dense MLPs lose them, and we say so
        assert "Linear layers of those names are not adapted" in capsys.readouterr().out


def test_dense_model_keeps_peft_all_linear(arch_model_dir):
    assert lora_targets(load(arch_model_dir, "llama"), ("all",)) == LoraTargets("all-linear")


@pytest.mark.parametrize(("name", "target", "reason"), [
    ("qwen3_moe", "gate", "mixture-of-experts router, a Qwen3MoeTopKRouter"),
    ("gpt_oss", "router", "mixture-of-experts router, a GptOssTopKRouter"),
])
def test_router_by_name_is_refused_with_the_reason(name, target, reason, arch_model_dir):
    with pytest.raises(ConfigError, match=reason) as raised:
        lora_targets(load(arch_model_dir, name), ("q_proj", target))
    assert str(raised.value).startswith(f"lora_target ({target})")


def test_fused_expert_weight_by_name_is_adapted_as_a_parameter(arch_model_dir):
    assert lora_targets(load(arch_model_dir, "mixtral"), ("q_proj", "gate_up_proj")) == LoraTargets(
        ["q_proj"], ["experts.gate_up_proj"])


# --- per-expert checkpoints read into fused expert weights (the sharding engines' loading path) ---

@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_fused_expert_tensors_read_from_the_files_equal_from_pretrained(name, arch_model_dir):
    from shardtune.model.conversion import converted_weights
    from shardtune.model.weights import open_weights

    folder = arch_model_dir(name)
    model = load(arch_model_dir, name)
    reader = converted_weights(open_weights(folder), model)
    for key, value in model.state_dict().items():
        assert key in reader, key
        torch.testing.assert_close(reader.read(key), value, rtol=0, atol=0, msg=key)
    for key in moe.fused_expert_parameters(model):  # a rank's shard: experts 2..3, a block of the other dims
        full = model.get_parameter(key)
        offsets, shape = (2, 1, 3), (2, full.shape[1] - 1, full.shape[2] - 3)
        block = full[2:4, 1:, 3:]
        assert tuple(block.shape) == shape
        torch.testing.assert_close(reader.read_slice(key, offsets, shape), block, rtol=0, atol=0, msg=key)


# --- ZeRO-3 leaf modules, found from the model ---

@pytest.mark.parametrize(("name", "leaf"), [
    ("qwen3_moe", "Qwen3MoeSparseMoeBlock"), ("mixtral", "MixtralSparseMoeBlock"), ("deepseek_v3", "DeepseekV3MoE"),
    ("gpt_oss", "GptOssMLP"), ("llama", None)])
def test_zero3_leaf_modules_are_the_sparse_blocks(name, leaf, arch_model_dir):
    from deepspeed.utils import z3_leaf_module

    from shardtune.engines.deepspeed import apply_zero3_moe_leaves

    model = load(arch_model_dir, name)
    assert apply_zero3_moe_leaves(model) == ([leaf] if leaf else [])
    leaves = [m for m in model.modules() if z3_leaf_module(m)]
    assert len(leaves) == len(list(moe.sparse_moe_blocks(model)))
    # DeepSeek-V3's first layer is dense: its MLP has no router and is no leaf
    assert all(type(m).__name__ == leaf for m in leaves)


def test_router_aux_loss_with_a_4d_packing_mask_is_refused_with_the_remedy(arch_model_dir):
    from shardtune.data.collator import block_causal_mask
    from shardtune.errors import ModelError
    from shardtune.train.loss import causal_lm_loss_terms

    model = load(arch_model_dir, "qwen3_moe")
    ids = torch.randint(5, 200, (1, 12))
    mask = block_causal_mask(torch.tensor([[1] * 5 + [2] * 7]), as_bool=True)
    with pytest.raises(ModelError, match="or moe_aux_loss_coef: 0"):
        causal_lm_loss_terms(model, {"input_ids": ids, "attention_mask": mask}, ids, 0, router_aux=True)
    loss, aux = causal_lm_loss_terms(model, {"input_ids": ids, "attention_mask": mask}, ids, 0)  # no aux: trains
    assert aux is None and float(loss) > 0


# ---- how the fused experts compute ----

def test_the_experts_implementation_follows_the_weights_dtype_on_cuda():
    assert moe.experts_implementation("cuda", "bfloat16")[0] == "grouped_mm"  # FSDP/DeepSpeed bf16 weights
    assert moe.experts_implementation("cuda", "float32")[0] == "eager"  # DDP / one process: fp32 under autocast
    assert moe.experts_implementation("cuda", "float16")[0] == "eager"
    assert moe.experts_implementation("cpu", "float32")[0] == "grouped_mm"  # transformers' own choice stays


def test_grouped_mm_escapes_autocast_and_eager_does_not(arch_model_dir):
    """Why fp32 expert weights get eager on CUDA: under bf16 autocast, transformers' grouped_mm casts the tokens to the
    weights' fp32 and computes the experts exactly as without autocast, while eager's matmuls run in bf16 like the
    rest of the model."""
    model = load(arch_model_dir, "qwen3_moe").eval()
    experts = next(block for _, block in moe.sparse_moe_blocks(model)).experts
    calls: list[tuple] = []
    experts.register_forward_pre_hook(lambda module, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=batch(0)["input_ids"])
    args, kwargs = calls[0]  # the tokens and routing the first sparse block's experts received

    def experts_output(choice: str, autocast: bool) -> torch.Tensor:
        model.set_experts_implementation(choice)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return experts(*args, **kwargs).float()

    exact = experts_output("grouped_mm", autocast=False)
    assert torch.allclose(experts_output("eager", autocast=False), exact, atol=1e-5)  # the same experts
    assert torch.allclose(experts_output("grouped_mm", autocast=True), exact, atol=1e-6)  # autocast did not reach it
    in_bf16 = experts_output("eager", autocast=True)
    assert not torch.allclose(in_bf16, exact, atol=1e-4) and torch.allclose(in_bf16, exact, atol=0.05)


def test_the_choice_is_set_on_the_model_and_said(arch_model_dir):
    model = load(arch_model_dir, "qwen3_moe")
    line = moe.apply_experts_implementation(model, "cuda", "float32")
    assert model.config._experts_implementation == "eager"
    assert line is not None and line.startswith("mixture of experts: experts_implementation eager (float32 expert")
    assert moe.apply_experts_implementation(model, "cuda", "bfloat16").startswith(
        "mixture of experts: experts_implementation grouped_mm")
    assert model.config._experts_implementation == "grouped_mm"
    assert moe.apply_experts_implementation(AutoModelForCausalLM.from_pretrained(arch_model_dir("llama")), "cuda",
                                            "float32") is None  # a dense model: nothing to choose


def test_a_model_whose_experts_cannot_switch_keeps_its_own():
    """Llama 4's class raises when asked to switch (the registry matrix found it: every llama4 cell failed)."""
    from shardtune.model.registry import tiny_registry_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_registry_config("llama4_text", 512))
    assert moe.fused_expert_parameters(model)
    assert moe.apply_experts_implementation(model, "cpu", "float32") == (
        "mixture of experts: the model's own experts code (its class cannot switch experts_implementation)")
