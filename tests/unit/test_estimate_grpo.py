"""Stage grpo in the estimate: the rollout phase (KV cache, a decoding step's logits, the prefill), the training phase
(one group of num_generations rows x prompt + completion tokens, full logits), the vllm_protocol_cpu generator's
host memory, the frozen reference of beta > 0, and SFT estimates left as they were. The cache's dtype is checked
against transformers' own cache (the one test here that imports torch)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardtune.config.args import load_config
from shardtune.estimate import Hardware, build_options, estimate_command
from shardtune.estimate.activations import activation_bytes
from shardtune.estimate.config import configured_option, hardware_for, model_shape_for, workload_from_config
from shardtune.estimate.grpo import (
    SAMPLED_LOGITS_COPIES,
    STEP_LOGITS_COPIES,
    generator_host,
    kv_cache_bytes,
    prefill_bytes,
    rollout_bytes,
)
from shardtune.estimate.parts import CPU_RUNTIME_BYTES, Components
from shardtune.estimate.shape import load_model_shape, shape_from_config
from tests.conftest import REPO

GiB = 1024**3
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 172, "vocab_size": 2048, "tie_word_embeddings": False}
TINY_GRPO = str(REPO / "examples" / "grpo" / "tiny_letter.yaml")  # 4 generations, 12 new tokens, cutoff_len 64
TINY_LORA = str(REPO / "examples" / "tiny" / "sft_lora.yaml")
CONFIGS = REPO / "tests" / "fixtures" / "model_configs"
GPUS = Hardware(nodes=1, gpus_per_node=2, gpu_memory=80 * GiB, cpu_memory=512 * GiB)


@pytest.fixture
def tiny_model(tmp_path):
    """Only config.json: the estimate never reads weights."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path


def grpo(tiny_model, *overrides: str):
    config, _ = load_config([TINY_GRPO, f"model_name_or_path={tiny_model}", *overrides])
    return config


def options(config, hardware: Hardware = GPUS) -> dict:
    return {o.name: o for o in build_options(model_shape_for(config), workload_from_config(config), hardware)}


def cache_from_config_json(rows: int, tokens: int, dtype_bytes: int) -> int:
    """K and V of every layer, from config.json's own numbers (head_dim = hidden_size / heads)."""
    head_dim = TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"]
    return (2 * TINY_CONFIG["num_hidden_layers"] * TINY_CONFIG["num_key_value_heads"] * head_dim * rows * tokens
            * dtype_bytes)


# --- rollout phase ---

def test_kv_cache_is_k_and_v_of_every_layer_for_every_row_and_token(tiny_model):
    w = workload_from_config(grpo(tiny_model, "num_generations=4", "cutoff_len=64"))
    shape = model_shape_for(grpo(tiny_model))
    assert (w.micro_batch, w.seq_len, w.completion_tokens) == (4, 64, 12)
    assert kv_cache_bytes(shape, w.micro_batch, w.seq_len, 4) == cache_from_config_json(4, 64, 4) == 131072
    assert kv_cache_bytes(shape, 4, 64, 2) == cache_from_config_json(4, 64, 2)


def test_the_cache_takes_the_stream_dtype_under_autocast():
    """transformers' cache takes K's dtype, and K after the rotary embedding has the fp32 stream's: under bf16
    autocast over fp32 weights (DDP, FSDP) the cache is fp32, 4 bytes a value, and holds prompt + new - 1 tokens."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG, pad_token_id=0)).eval()
    rows, prompt, new = 3, 5, 6
    ids = torch.randint(3, 2048, (rows, prompt))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new,
                             min_new_tokens=new, return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == kv_cache_bytes(shape_from_config(TINY_CONFIG), rows, prompt + new - 1, 4)


def test_sliding_and_latent_caches_follow_the_shape():
    """Gemma 2 keeps the window on its sliding layers (every other one); DeepSeek-V3 caches its latent (kv_lora_rank
    + rope dim per token and layer), not K and V per head."""
    gemma = load_model_shape(str(CONFIGS / "gemma-2-9b"))
    tokens = 6000
    full, window = 21 * tokens, 21 * 4096
    assert kv_cache_bytes(gemma, 2, tokens, 2) == 2 * (full + window) * 2 * 8 * 256 * 2
    deepseek = load_model_shape(str(CONFIGS / "DeepSeek-V3"))
    assert kv_cache_bytes(deepseek, 2, 100, 2) == 2 * 61 * 100 * (512 + 64) * 2


def test_rollout_is_the_larger_of_the_prefill_and_the_last_step(tiny_model):
    """Long completions after a short prompt: the end of the generation (every row's cache at full length, one
    layer's K once more while torch.cat grows it, and one step's logits) outweighs the prefill; DDP's cache is fp32
    (the stream), DeepSpeed's bf16 (the module)."""
    config = grpo(tiny_model, "cutoff_len=1024", "max_completion_length=1000", "bf16=true")
    shape, w = model_shape_for(config), workload_from_config(config)
    step = STEP_LOGITS_COPIES * 4 * 2048 * 4

    def end(dtype_bytes: int) -> int:
        return cache_from_config_json(4, 1024, dtype_bytes) * (1 + 1 / (2 * 2)) + step  # 2 layers, K and V each

    o = options(config)
    assert o["DDP"].device.rollout == end(4) > prefill_bytes(shape, w, 4)
    assert o["ZeRO-2"].device.rollout == end(2)
    # A long prompt: its prefill (the prompts' cache and one layer's tensors on all their tokens) is the larger.
    long_prompt = workload_from_config(grpo(tiny_model, "cutoff_len=1024", "max_completion_length=4"))
    assert rollout_bytes(shape, long_prompt, 4) == prefill_bytes(shape, long_prompt, 4) > end(4)


def test_a_step_holds_the_larger_phase():
    on_top = Components(parameters=10.0, buffers=1.0, reference=2.0)
    assert dataclasses.replace(on_top, activations=5.0, rollout=7.0).measurable == 13.0 + 7.0
    assert dataclasses.replace(on_top, activations=5.0, rollout=3.0).measurable == 13.0 + 5.0


# --- training phase ---

def test_training_is_one_group_of_prompt_plus_completion_tokens(tiny_model):
    """num_generations rows of cutoff_len tokens (the prompt is at most cutoff_len - max_completion_length), the full
    logits: the forward's every-position logits + 2 fp32 copies of the completion positions, or the backward's 4."""
    config = grpo(tiny_model)
    shape, w = model_shape_for(config), workload_from_config(config)
    assert (w.micro_batch, w.seq_len, w.loss_chunk_size) == (4, 64, 0)
    n, t, c, v = 4, 64, 12, 2048
    logits = max(n * t * v * 4 + 2 * n * c * v * 4, 4 * n * c * v * 4)
    sft_like = dataclasses.replace(w, completion_tokens=0)
    assert activation_bytes(shape, w, 4) - activation_bytes(shape, sft_like, 4) == logits - 3 * n * t * v * 4
    assert options(config)["DDP"].device.activations == activation_bytes(shape, w, 4)
    # More prompts per micro-batch are more groups, trained one after the other: no more activations.
    wider = workload_from_config(grpo(tiny_model, "per_device_train_batch_size=16"))
    assert activation_bytes(shape, wider, 4) == activation_bytes(shape, w, 4)


def test_max_completion_length_moves_the_logits_by_their_completion_copies(tiny_model):
    """cutoff_len bounds prompt + completion, so a longer completion leaves the cache and the training rows as they
    were; the training logits grow by 2 fp32 copies of the added completion positions (the forward is the larger
    here), the generator's kept logits by 3."""
    short, long = (grpo(tiny_model, "cutoff_len=2048", f"max_completion_length={c}",
                        "rollout_backend=vllm_protocol_cpu") for c in (900, 1000))
    added = 4 * 100 * 2048 * 4  # rows x added tokens x vocab x fp32
    shape = model_shape_for(short)
    assert options(long)["DDP"].device.activations - options(short)["DDP"].device.activations == 2 * added
    host_short, host_long = (generator_host(shape, workload_from_config(c)) for c in (short, long))
    assert host_short is not None and host_long is not None
    assert host_long.rollouts - host_short.rollouts == SAMPLED_LOGITS_COPIES * added
    assert options(long)["DDP"].cpu_per_node - options(short)["DDP"].cpu_per_node == SAMPLED_LOGITS_COPIES * added


def test_num_generations_scales_the_cache_and_the_activations(tiny_model):
    four, eight = (grpo(tiny_model, f"num_generations={n}", "per_device_train_batch_size=8") for n in (4, 8))
    shape = model_shape_for(four)
    w4, w8 = workload_from_config(four), workload_from_config(eight)
    assert kv_cache_bytes(shape, w8.micro_batch, w8.seq_len, 4) - kv_cache_bytes(shape, w4.micro_batch, w4.seq_len, 4) \
        == cache_from_config_json(4, 64, 4)
    o4, o8 = options(four)["DDP"].device, options(eight)["DDP"].device
    assert o8.activations == 2 * o4.activations
    assert o8.rollout == 2 * o4.rollout
    assert o8.total > o4.total


# --- what else a grpo run holds ---

def test_vllm_protocol_cpu_adds_one_weight_copy_and_its_rollouts_in_host_memory(tiny_model):
    own, external = grpo(tiny_model, "bf16=true"), grpo(tiny_model, "bf16=true", "rollout_backend=vllm_protocol_cpu")
    shape = model_shape_for(own)
    host = generator_host(shape, workload_from_config(external))
    assert host is not None and generator_host(shape, workload_from_config(own)) is None
    assert host.weights == 2 * shape.total_params  # the whole model in bf16, the run's dtype
    assert host.runtime == CPU_RUNTIME_BYTES
    for hardware in (GPUS, hardware_for(2, 2, None, 512 * GiB)):  # GPU ranks, and ranks on the CPU
        before, after = options(own, hardware), options(external, hardware)
        for name, option in after.items():
            assert option.device.rollout == 0 < before[name].device.rollout  # the ranks generate nothing
            assert option.generator_per_node == host.total
    # GPU ranks: DDP keeps nothing in host memory while training; the generator's process outweighs the loading.
    assert options(external)["DDP"].cpu_per_node == host.total + 2 * CPU_RUNTIME_BYTES
    # CPU ranks: the node holds its ranks' tensors, the generator and every rank's interpreter.
    on_cpu = options(external, hardware_for(2, 2, None, 512 * GiB))["DDP"]
    assert on_cpu.cpu_per_node == 2 * on_cpu.device.total + host.total + 2 * CPU_RUNTIME_BYTES


def test_beta_places_a_frozen_copy_for_full_runs_only(tiny_model):
    for beta, finetuning, held in ((0.0, "full", False), (0.04, "full", True), (0.04, "lora", False)):
        w = workload_from_config(grpo(tiny_model, f"beta={beta}", f"finetuning_type={finetuning}"))
        assert w.reference_copy is held
    option = options(grpo(tiny_model, "beta=0.04"))["DDP"].device
    assert option.reference == option.parameters  # fp32 replica, as DDP holds the policy


def test_the_report_names_both_phases(tiny_model, capsys):
    argv = [TINY_GRPO, f"model_name_or_path={tiny_model}", "--gpu-memory", "80GiB", "--cpu-memory", "64GiB"]
    assert estimate_command(argv) == 0
    table = capsys.readouterr().out
    assert "grpo rollout phase ('rollout'" in table and "grpo training phase ('activ')" in table
    assert "KV cache of 4 rows x 64 tokens (128 KiB)" in table
    assert "4 rows x 64 tokens (prompt up to 52 + completion 12)" in table
    header = next(line for line in table.splitlines() if line.startswith("option"))
    assert header.split()[5:8] == ["activ", "rollout", "overhead"]
    assert estimate_command([*argv, "rollout_backend=vllm_protocol_cpu"]) == 0
    assert "vllm_protocol_cpu generates in a process of its own on rank 0's node" in capsys.readouterr().out
    assert estimate_command([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(o["device_bytes"]["rollout"] > 0 for o in data["options"])
    assert data["workload"]["completion_tokens"] == 12


def test_a_grpo_run_compares_its_measured_peak_with_the_larger_phase(tiny_model):
    """What a finished run records beside its measured peak (compare.py) holds the larger phase too."""
    from shardtune.estimate.config import estimate_run_memory

    config = grpo(tiny_model, "cutoff_len=1024", "max_completion_length=1000")
    found = estimate_run_memory(config, 1, "local")
    device = configured_option(config, hardware_for(1, 1, None, 64 * GiB)).device
    assert found is not None and found.training == device.measurable
    assert device.rollout > 0


# --- SFT and preference estimates as they were ---

# Device totals and CPU memory per node from the estimate before stage grpo was counted (commit ff2e840), 2 GPUs;
# ZeRO-3 LoRA since it counts the adapters in fp32 and their whole copies beside the partition (issue 42.10; was
# 3199876845).
BEFORE_GRPO = {
    (): {"DDP": (1099053376, 2152016640), "ZeRO-3": (3199881146, 2148896000),
         "FSDP FULL_SHARD": (1099717178, 2148896000)},
    ("stage=dpo", "finetuning_type=full", "bf16=true"): {
        "DDP": (1156791616, 2154545408), "ZeRO-3": (2197209098, 2148896000),
        "FSDP FULL_SHARD": (1155488541, 2148896000)},
}


@pytest.mark.parametrize("overrides", list(BEFORE_GRPO), ids=["sft_lora", "dpo_full_bf16"])
def test_other_stages_are_estimated_as_before(tiny_model, overrides):
    config, _ = load_config([TINY_LORA, f"model_name_or_path={tiny_model}", *overrides])
    w = workload_from_config(config)
    assert (w.completion_tokens, w.external_generator, w.is_grpo) == (0, False, False)
    found = options(config)
    for name, (total, cpu) in BEFORE_GRPO[overrides].items():
        assert (int(round(found[name].device.total)), int(round(found[name].cpu_per_node))) == (total, cpu)
    assert all(o.device.rollout == 0 and o.generator_per_node == 0 for o in found.values())
    assert "rollout" not in found["DDP"].device.to_dict()
