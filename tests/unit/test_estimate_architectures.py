"""The estimate for every architecture family users bring: parameter counts from config.json alone, checked
against the model transformers builds (meta device, real sizes) and the published totals; MoE total vs active;
latent attention; tied embeddings; sliding windows; engine ordering; gradient checkpointing; the CLI's report.

The config.json files in tests/fixtures/model_configs are the published configs of real models (sizes only).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardtune.estimate.activations import (
    activation_bytes,
    decoder_activation_bytes,
    input_bytes,
    layer_activation_bytes,
)
from shardtune.estimate.adapter_shape import lora_params
from shardtune.estimate.command import estimate_command
from shardtune.estimate.hardware import GiB, Hardware
from shardtune.estimate.options import build_options
from shardtune.estimate.recommend import recommend
from shardtune.estimate.shape import ModelShape, load_model_shape, shape_from_config
from shardtune.estimate.workload import Workload, trainable_params
from shardtune.estimate.zero import moe_leaf_params

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "fixtures" / "model_configs"
LLAMA3_FULL = str(REPO / "examples" / "train_full" / "llama3_full_sft.yaml")

# Published totals (model cards), in billions: (total, active). Published figures are rounded to two or three
# significant digits, so the estimate must agree within PUBLISHED_TOLERANCE (relative).
PUBLISHED = {
    "Qwen3-8B": (8.2, None),
    "Qwen3-30B-A3B": (30.5, 3.3),
    "Mistral-7B-v0.3": (7.25, None),
    "Mixtral-8x7B-v0.1": (46.7, 12.9),
    "gemma-2-9b": (9.24, None),
    "gemma-3-27b-text": (27.0, None),  # the text model; the published 27.4B adds the 0.4B SigLIP vision tower
    "Phi-3-mini-4k-instruct": (3.8, None),
    "phi-4": (14.7, None),
    "DeepSeek-V3": (671, 37),  # without the 14B multi-token-prediction module (685B with it), as transformers
    "gpt-oss-20b": (20.91, 3.61),  # OpenAI's active count leaves out the embedding lookup
    "GLM-4-9B-0414": (9.4, None),
}
PUBLISHED_TOLERANCE = 0.02
ACTIVE_WITHOUT_EMBEDDING = {"gpt-oss-20b"}
MOE = {"Qwen3-30B-A3B", "Mixtral-8x7B-v0.1", "DeepSeek-V3", "gpt-oss-20b"}
EIGHT_H100 = Hardware(nodes=1, gpus_per_node=8, gpu_memory=80 * GiB, cpu_memory=2048 * GiB)


def shape_of(name: str) -> ModelShape:
    return load_model_shape(None, str(CONFIGS / name))


def config_json(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def bf16(**kwargs) -> Workload:
    return Workload(**{"micro_batch": 1, "seq_len": 4096, "precision": "bf16", "gradient_checkpointing": True,
                       **kwargs})


# --- parameter counts ---

@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_totals_match_the_published_numbers(name):
    shape = shape_of(name)
    total, active = PUBLISHED[name]
    assert shape.total_params / 1e9 == pytest.approx(total, rel=PUBLISHED_TOLERANCE)
    if active is None:
        assert shape.active_params == shape.total_params and shape.moe is None
        return
    counted = shape.active_params - (shape.embedding_params if name in ACTIVE_WITHOUT_EMBEDDING else 0)
    assert counted / 1e9 == pytest.approx(active, rel=PUBLISHED_TOLERANCE)
    assert shape.active_params < shape.total_params / 3


def _meta_model(name: str):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**config_json(name))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_equal_the_model_transformers_builds(name):
    """Real sizes on the meta device: total, expert weights, tie, and every nn.Linear of a layer (what LoRA adapts)."""
    model = _meta_model(name)
    shape = shape_of(name)
    assert sum(p.numel() for p in model.parameters()) == shape.total_params  # a tied matrix is yielded once
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == shape.tie_word_embeddings
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    routers = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".gate.weight", ".router.weight",
                                                                                ".router.bias")))
    assert experts + routers == shape.expert_params
    for index in sorted({0, shape.num_layers - 1}):
        linears = {n.rsplit(".", 1)[-1]: (m.in_features, m.out_features, m.bias is not None)
                   for n, m in model.model.layers[index].named_modules() if type(m).__name__ == "Linear"}
        assert linears == shape.layer_linear_shapes(index), index


@pytest.mark.parametrize("name", sorted(MOE))
def test_active_parameters_count_top_k_experts(name):
    shape = shape_of(name)
    moe = shape.moe
    assert moe is not None and moe.top_k < moe.experts
    per_expert = moe.expert_params(shape.hidden_size)
    assert shape.total_params - shape.active_params == shape.moe_layers * (moe.experts - moe.top_k) * per_expert


def test_moe_and_mla_shapes_from_config_json():
    ds = shape_of("DeepSeek-V3")
    assert ds.mla is not None and (ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.mla.qk_head_dim) == (1536, 512, 192)
    assert ds.moe is not None and ds.moe.dense_layers == (0, 1, 2) and ds.moe_layers == 58
    assert ds.moe.shared_intermediate == 2048 and not ds.moe.aux_loss  # auxiliary-loss-free balancing
    oss = shape_of("gpt-oss-20b")
    assert oss.attention_sinks and oss.moe is not None and oss.moe.expert_bias and oss.moe.router_bias
    assert (oss.sliding_window, oss.sliding_layers) == (128, 12)
    assert shape_of("gemma-3-27b-text").sliding_layers == 52  # five local layers per global one
    assert shape_of("gemma-2-9b").sliding_layers == 21
    assert shape_of("Mistral-7B-v0.3").sliding_window is None  # v0.3 has no window
    assert shape_of("Qwen3-30B-A3B").moe.aux_loss  # router_aux_loss_coef: the load-balancing loss is computed


def test_tied_embeddings_are_counted_once():
    qwen = shape_of("Qwen3-8B")
    tied = dataclasses.replace(qwen, tie_word_embeddings=True)
    assert qwen.total_params - tied.total_params == qwen.vocab_size * qwen.hidden_size
    gemma = shape_of("gemma-3-27b-text")
    assert gemma.tie_word_embeddings and gemma.head_params == 0
    untied_gemma = {k: v for k, v in config_json("gemma-2-9b").items() if k != "tie_word_embeddings"}
    assert shape_from_config(untied_gemma).tie_word_embeddings  # Gemma's config class ties when unsaid


def test_lora_all_adapts_linear_layers_never_the_router_or_fused_experts():
    """lora_target all = peft's all-linear: attention, plain MLPs and shared experts; the router and the fused
    expert tensors are no nn.Linear (transformers 5)."""
    qwen = shape_of("Qwen3-30B-A3B")
    attention = sum(8 * (i + o) for i, o, _ in qwen.attention_linear_shapes().values())
    assert lora_params(qwen, 8, ["all"]) == qwen.num_layers * attention
    ds = shape_of("DeepSeek-V3")
    names = set(ds.linear_module_names)
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "down_proj"} <= names
    assert "gate" not in names and "router" not in names
    assert set(shape_of("Phi-3-mini-4k-instruct").linear_module_names) == {"qkv_proj", "o_proj", "gate_up_proj",
                                                                          "down_proj"}
    assert lora_params(ds, 8, ["q_a_proj"]) == ds.num_layers * 8 * (7168 + 1536)


@pytest.mark.parametrize(("model_type", "extra"), [
    ("qwen2_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 96}),
    ("deepseek_v2", {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "n_shared_experts": 2, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
                     "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "num_key_value_heads": 4,
                     "n_group": 1, "topk_group": 1}),
    ("glm4_moe", {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "n_shared_experts": 1, "first_k_dense_replace": 1, "head_dim": 16, "n_group": 1, "topk_group": 1}),
])
def test_more_moe_families_at_tiny_size(model_type, extra):
    """Qwen2-MoE's gated shared expert, DeepSeek-V2's MLA without a q latent, GLM-4-MoE: counted exactly too."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **{
        "vocab_size": 1000, "pad_token_id": 0, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, **extra})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(config.to_dict())
    assert shape.counts_checked and shape.moe is not None
    assert sum(p.numel() for p in model.parameters()) == shape.total_params


def test_unchecked_families_are_reported_as_approximate(capsys, tmp_path):
    olmoe = {"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
             "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 50304, "num_experts": 64,
             "num_experts_per_tok": 8}
    (tmp_path / "config.json").write_text(json.dumps(olmoe))
    assert estimate_command([LLAMA3_FULL, f"model_name_or_path={tmp_path}", "--gpus-per-node", "8",
                             "--gpu-memory", "80GiB", "--cpu-memory", "2TiB"]) == 0
    assert "model_type olmoe: read as a LLaMA-style decoder" in capsys.readouterr().out
    assert all(shape_of(name).counts_checked for name in PUBLISHED)


# --- memory ---

@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_engine_ordering_and_checkpointing(name):
    """Full fine-tuning on 8 GPUs: each ZeRO stage holds less model state than the one before, FSDP shards the
    fp32 weights eightfold, LoRA trains a sliver; checkpointing lowers the activations of every option."""
    shape = shape_of(name)
    options = {o.name: o for o in build_options(shape, bf16(), EIGHT_H100)}
    states = [options[n].device.model_states for n in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4
    assert options["FSDP FULL_SHARD"].device.parameters == pytest.approx(options["DDP"].device.parameters / 8)
    assert options["ZeRO-3"].device_peak < options["ZeRO-1"].device_peak
    no_checkpointing = {o.name: o for o in build_options(shape, bf16(gradient_checkpointing=False), EIGHT_H100)}
    for option_name, option in options.items():
        assert option.device.activations < no_checkpointing[option_name].device.activations, option_name
    lora = bf16(finetuning_type="lora", lora_rank=16)
    assert 0 < trainable_params(shape, lora) < shape.total_params / 100


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_activations_follow_top_k_and_states_follow_every_expert(name):
    shape = shape_of(name)
    w = bf16(gradient_checkpointing=False)
    assert shape.moe is not None
    more_experts = dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, experts=2 * shape.moe.experts))
    wider_routing = dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, top_k=2 * shape.moe.top_k))
    # every expert is resident and trains: ZeRO-3's model states grow with the experts ...
    zero3 = {s: next(o for o in build_options(s, w, EIGHT_H100) if o.name == "ZeRO-3") for s in (shape, more_experts)}
    assert zero3[more_experts].device.model_states > 1.5 * zero3[shape].device.model_states
    # ... while a token's activations follow the experts it is routed to (and only the router logits grow)
    last = shape.num_layers - 1
    assert layer_activation_bytes(wider_routing, w, 2, w.seq_len, last) > layer_activation_bytes(shape, w, 2,
                                                                                                 w.seq_len, last)
    growth = layer_activation_bytes(more_experts, w, 2, w.seq_len, last) - layer_activation_bytes(shape, w, 2,
                                                                                                  w.seq_len, last)
    assert growth == shape.moe.experts * (2 + 4 + (4 if shape.moe.aux_loss else 0))  # logits, probs, aux softmax


def test_checkpointing_recomputes_the_largest_layer():
    ds = shape_of("DeepSeek-V3")
    w = bf16()
    dense = layer_activation_bytes(ds, w, 2, w.seq_len, 0)
    moe = layer_activation_bytes(ds, w, 2, w.seq_len, ds.num_layers - 1)
    assert moe > dense
    checkpointed = decoder_activation_bytes(ds, w, 2)
    assert checkpointed - decoder_activation_bytes(ds, bf16(micro_batch=1, seq_len=4096), 2) == 0
    per_token = ds.num_layers * ds.hidden_size * 2 + moe
    assert checkpointed > w.tokens * per_token - 1  # inputs of every layer + one recomputed MoE layer (+ final)
    full = decoder_activation_bytes(ds, bf16(gradient_checkpointing=False), 2)
    assert full > 10 * checkpointed


def test_gpt_oss_attention_is_eager_whatever_sdpa_says():
    """transformers has no SDPA path for attention sinks: the probabilities (over S + 1 columns) are kept."""
    oss = shape_of("gpt-oss-20b")
    w = bf16(gradient_checkpointing=False, seq_len=1024)
    assert layer_activation_bytes(oss, w, 2, 1024) == layer_activation_bytes(
        oss, dataclasses.replace(w, attn_implementation="eager"), 2, 1024)
    without_sinks = dataclasses.replace(oss, attention_sinks=False)
    assert layer_activation_bytes(oss, w, 2, 1024) - layer_activation_bytes(without_sinks, w, 2, 1024) > \
        oss.num_heads * 1024 * 4


@pytest.mark.parametrize(("name", "picked"), [("Qwen3-8B", "sdpa"), ("gpt-oss-20b", "eager"), ("gemma-2-9b", "eager")])
def test_auto_attention_is_estimated_as_the_kernel_auto_picks_without_flash(name, picked):
    """`attn_implementation: auto` (the default) estimates what model/attention.py picks without flash-attn."""
    shape = shape_of(name)
    w = bf16(gradient_checkpointing=False, seq_len=1024, attn_implementation="auto")
    assert layer_activation_bytes(shape, w, 2, 1024) == layer_activation_bytes(
        shape, dataclasses.replace(w, attn_implementation=picked), 2, 1024)


def test_sliding_windows_change_no_memory_term_but_hybrid_models_carry_two_masks():
    gemma = shape_of("gemma-3-27b-text")
    global_only = dataclasses.replace(gemma, sliding_window=None, sliding_layers=0)
    w = bf16(gradient_checkpointing=False)
    assert decoder_activation_bytes(gemma, w, 2) == decoder_activation_bytes(global_only, w, 2)
    assert input_bytes(w, gemma) - input_bytes(w, global_only) == w.tokens * w.seq_len  # a second bool mask
    flash = bf16(attn_implementation="flash_attention_2")
    assert input_bytes(flash, gemma) == input_bytes(flash, global_only)
    every_layer = dataclasses.replace(gemma, sliding_layers=gemma.num_layers)  # Mistral-style: one mask
    assert input_bytes(w, every_layer) == input_bytes(w, global_only)


def test_zero3_gathers_a_whole_moe_block_as_one_leaf():
    qwen = shape_of("Qwen3-30B-A3B")
    block = moe_leaf_params(qwen)
    assert block == 128 * 3 * 2048 * 768 + 128 * 2048  # experts + router
    ds = shape_of("DeepSeek-V3")
    assert moe_leaf_params(ds) > 1e9  # beyond stage3_max_live_parameters: the leaf is gathered anyway
    zero3 = next(o for o in build_options(ds, bf16(finetuning_type="lora"), EIGHT_H100) if o.name == "ZeRO-3")
    assert zero3.device.buffers >= 2 * moe_leaf_params(ds)
    assert moe_leaf_params(shape_of("Qwen3-8B")) == 0


# --- recommendations ---

def test_deepseek_v3_full_fine_tuning_does_not_fit_one_node_of_eight_80gib_gpus():
    ds = shape_of("DeepSeek-V3")
    result = recommend(build_options(ds, bf16(), EIGHT_H100), EIGHT_H100, bf16())
    assert result.option is None and "no option fits" in result.reason
    assert "enable gradient_checkpointing" not in result.reason and "use LoRA" in result.reason
    assert "gradient_checkpointing is on already" in result.reason
    # 671B x (2 + 2 + 12) bytes of ZeRO-3 model states need about 10.7 TB across the ranks: 32 nodes suffice
    many = Hardware(nodes=32, gpus_per_node=8, gpu_memory=80 * GiB, cpu_memory=2048 * GiB)
    best = recommend(build_options(ds, bf16(), many), many).option
    assert best is not None and best.name == "ZeRO-3"


def test_qwen3_30b_a3b_lora_fits_under_zero3_on_eight_gpus():
    qwen = shape_of("Qwen3-30B-A3B")
    options = {o.name: o for o in build_options(qwen, bf16(finetuning_type="lora"), EIGHT_H100)}
    assert options["ZeRO-3"].fits and options["ZeRO-3"].device_peak < 20 * GiB
    assert not options["DDP"].fits  # 30.5B fp32 weights on each GPU
    full = {o.name: o for o in build_options(qwen, bf16(), EIGHT_H100)}
    assert full["ZeRO-3"].fits and not full["ZeRO-2"].fits


def test_engine_auto_and_check_read_the_architecture(tmp_path):
    from shardtune.config.args import load_config
    from shardtune.estimate.config import fit_warning, recommend_for_config

    model = str(CONFIGS / "Qwen3-30B-A3B")
    lora, _ = load_config([LLAMA3_FULL, f"model_name_or_path={model}", "finetuning_type=lora"])
    values, reason = recommend_for_config(lora, 8, 8, 80 * GiB, 2048 * GiB)
    assert values.get("deepspeed") in ("z1", "z2", "z3") and "fits" in reason
    full, _ = load_config([LLAMA3_FULL, f"model_name_or_path={model}", "deepspeed=z2"])
    warning = fit_warning(full, 8, 8, 80 * GiB, 2048 * GiB)
    assert warning is not None and "ZeRO-2" in warning and "ZeRO-3 would fit" in warning


def test_estimate_command_reports_moe_and_mla_facts(capsys):
    args = ["--gpus-per-node", "8", "--gpu-memory", "80GiB", "--cpu-memory", "2TiB"]
    assert estimate_command([LLAMA3_FULL, f"model_name_or_path={CONFIGS / 'DeepSeek-V3'}", *args]) == 0
    out = capsys.readouterr().out
    assert "mixture of experts: 256 experts, top-8 + shared width 2048, 3 dense layers; 671B total, 37.6B active" in out
    assert "latent attention: q_lora_rank 1536, kv_lora_rank 512, qk head 128+64 (nope+rope), v head 128" in out
    assert "recommended: none" in out
    assert estimate_command([LLAMA3_FULL, f"model_name_or_path={CONFIGS / 'gpt-oss-20b'}", "finetuning_type=lora",
                             "--json", *args]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["total_params"] == shape_of("gpt-oss-20b").total_params
    assert data["model"]["active_params"] == shape_of("gpt-oss-20b").active_params
    assert data["model"]["moe"]["experts"] == 32 and data["model"]["attention_sinks"]
    assert data["recommendation"]["name"] is not None
    assert estimate_command([LLAMA3_FULL, f"model_name_or_path={CONFIGS / 'gemma-3-27b-text'}", *args]) == 0
    out = capsys.readouterr().out
    assert "tied embeddings" in out and "sliding window 1024 on 52 of 62 layers" in out


# --- activations against what autograd keeps (tiny models of each family, fp32, CPU) ---

# Per-token bytes of one decoder layer, estimate / measured: within 0.3% for most families; Phi-3 and GLM-4 keep
# one more h-wide tensor around their fused projections than the estimate counts (0.95, 0.96), DeepSeek-V3's
# grouped sigmoid routing keeps a few more index tensors than the router term (0.99).
ACTIVATION_TOLERANCE = {"phi3": 0.06, "glm4": 0.05, "deepseek_v3": 0.02}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3", "deepseek_v3",
                                  "gpt_oss", "glm4"])
def test_layer_activations_match_autograds_saved_tensors(arch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from shardtune.model.architectures import family

    spec = family(arch)
    extra = dict(spec.config)
    if "layer_types" in extra:
        extra["layer_types"] = ["sliding_attention", "full_attention"]
    # GPT-OSS and Gemma 2 need eager (sinks, soft-capping); with DeepSeek's unequal q/k and v head dims SDPA
    # falls back on the CPU to its math path, which keeps what eager keeps.
    attn = "eager" if arch in ("gpt_oss", "gemma2", "deepseek_v3") else "sdpa"
    config = transformers.AutoConfig.for_model(spec.model_type, **{
        "vocab_size": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().train()
    batch, seq = 2, 64
    measured = _saved_bytes_of_last_layer(torch, model, batch, seq)
    shape = shape_from_config(config.to_dict())
    w = Workload(micro_batch=batch, seq_len=seq, attn_implementation=attn)
    estimate = layer_activation_bytes(shape, w, 4, seq) * batch * seq
    assert estimate == pytest.approx(measured, rel=ACTIVATION_TOLERANCE.get(arch, 0.01))
    assert activation_bytes(shape, w, 4) > estimate


def _saved_bytes_of_last_layer(torch, model, batch: int, seq: int) -> int:
    """Distinct storages autograd saves in the last decoder layer's forward, without parameters and without the
    rotary cos/sin (computed once and shared by every layer)."""
    layer = model.model.layers[-1]
    saved: dict[int, int] = {}
    shared: set[int] = set()

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    def pre_hook(_module, _args, kwargs):
        for t in kwargs.get("position_embeddings") or ():
            shared.add(t.untyped_storage().data_ptr())

    forward = layer.forward

    def hooked(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return forward(*args, **kwargs)

    layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    layer.forward = hooked
    ids = torch.randint(3, 512, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -4:] = 0  # padding: a dense mask, as packed rows have
    model(input_ids=ids, attention_mask=mask)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in params and ptr not in shared)


def test_checkpointing_keys_reach_the_estimate(tmp_path):
    """gradient_checkpointing (and LLaMA-Factory's disable_gradient_checkpointing) switch the activation term."""
    from shardtune.config.args import load_config
    from shardtune.estimate.config import workload_from_config

    model = f"model_name_or_path={CONFIGS / 'Qwen3-30B-A3B'}"
    qwen = shape_of("Qwen3-30B-A3B")
    on, _ = load_config([LLAMA3_FULL, model])
    off, _ = load_config([LLAMA3_FULL, model, "gradient_checkpointing=false"])
    lf_yaml = tmp_path / "lf.yaml"
    lines = Path(LLAMA3_FULL).read_text().splitlines()
    lf_yaml.write_text("\n".join([line for line in lines if not line.startswith("gradient_checkpointing:")]
                                  + ["disable_gradient_checkpointing: true"]) + "\n")
    lf_off, _ = load_config([str(lf_yaml), model])
    w_on, w_off = workload_from_config(on), workload_from_config(off)
    assert w_on.gradient_checkpointing and not w_off.gradient_checkpointing
    assert workload_from_config(lf_off) == w_off
    saved = activation_bytes(qwen, w_off, 2) - activation_bytes(qwen, w_on, 2)
    per_token_layers = sum(layer_activation_bytes(qwen, w_off, 2, w_off.seq_len, i) for i in range(qwen.num_layers))
    last = layer_activation_bytes(qwen, w_off, 2, w_off.seq_len)
    assert saved == w_on.tokens * (per_token_layers - qwen.num_layers * qwen.hidden_size * 2 - last)


class _Tokenizer:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self) -> int:
        return 300


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3",
                                  "phi3", "deepseek_v3", "gpt_oss", "glm4"])
def test_every_tiny_family_config_reads_exactly(arch):
    """The configs `make-tiny-model --arch` writes: the estimate reads each family's config.json exactly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from shardtune.model.architectures import tiny_config

    config = tiny_config(arch, tokenizer=_Tokenizer(), layers=4, hidden=64, heads=4, kv_heads=2, intermediate=96,
                         max_positions=256)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(json.loads(config.to_json_string()))
    assert sum(p.numel() for p in model.parameters()) == shape.total_params
    assert shape.counts_checked


def test_fused_experts_keep_activations_in_the_weight_dtype():
    """grouped_mm is outside autocast and casts its input to the weights' dtype: fp32 under DDP/FSDP (fp32 weights,
    autocast), bf16 under DeepSpeed (the module cast); dense MLPs keep bf16 either way."""
    from shardtune.estimate.activations import mlp_bytes

    qwen = shape_of("Qwen3-30B-A3B")
    w = bf16(gradient_checkpointing=False)
    moe = qwen.moe
    assert moe is not None
    routed = moe.top_k * (2 * qwen.hidden_size + 4 * moe.expert_intermediate)
    assert mlp_bytes(qwen, w, 0, 4) - mlp_bytes(qwen, w, 0, 2) == 2 * routed
    ds = shape_of("DeepSeek-V3")
    assert mlp_bytes(ds, w, 0, 4) == mlp_bytes(ds, w, 0, 2) == 4 * ds.intermediate_size * 2  # a dense layer


def test_qlora_quantizes_linear_layers_only():
    """bitsandbytes replaces nn.Linear: on Qwen3-30B-A3B that is attention alone, and the fused experts stay in
    fp32 after prepare_model_for_kbit_training, so QLoRA saves little there."""
    from shardtune.estimate.workload import quantized_linear_params, weight_bytes

    qwen = shape_of("Qwen3-30B-A3B")
    qlora = bf16(finetuning_type="qlora", quantization_bit=4)
    assert quantized_linear_params(qwen, qlora) == qwen.decoder_linear_params
    assert qwen.decoder_linear_params < qwen.total_params / 10
    assert weight_bytes(qwen, qlora, 4) > 4 * qwen.expert_params
    assert weight_bytes(qwen, qlora, 4) / qwen.total_params > 3.5  # bytes per parameter
    dense = shape_of("Qwen3-8B")  # NF4 layers, fp32 embedding and head
    assert weight_bytes(dense, qlora, 4) / dense.total_params < 1.1
