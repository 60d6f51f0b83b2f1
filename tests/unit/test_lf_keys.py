"""LLaMA-Factory model, output and memory keys: accepted with LLaMA-Factory's meaning, and shown to take effect."""

from __future__ import annotations

import pytest
import torch

from shardtune.config.load import build_config
from shardtune.errors import ConfigError, ModelError
from shardtune.launch.validate import cross_key_problems

BASE = {"model_name_or_path": "org/model", "dataset": "demo", "output_dir": "out"}


# --- spellings -> shardtune keys ---

@pytest.mark.parametrize(("flash_attn", "expected"), [("auto", "auto"), ("sdpa", "sdpa"), ("disabled", "eager"),
                                                      ("fa2", "flash_attention_2")])
def test_flash_attn_maps_onto_attn_implementation(flash_attn, expected):
    assert build_config({**BASE, "flash_attn": flash_attn}).attn_implementation == expected


def test_flash_attn_rejects_unknown_values_and_contradictions():
    with pytest.raises(ConfigError, match="flash_attn: 'fa3' is not allowed"):
        build_config({**BASE, "flash_attn": "fa3"})
    with pytest.raises(ConfigError, match="'flash_attn' .* contradicts 'attn_implementation'"):
        build_config({**BASE, "flash_attn": "disabled", "attn_implementation": "sdpa"})


def test_gradient_checkpointing_spellings():
    assert build_config({**BASE, "disable_gradient_checkpointing": False}).gradient_checkpointing is True
    assert build_config({**BASE, "disable_gradient_checkpointing": True}).gradient_checkpointing is False
    c = build_config({**BASE, "gradient_checkpointing": True, "use_reentrant_gc": True})
    assert c.gradient_checkpointing_kwargs == {"use_reentrant": True}
    c = build_config({**BASE, "gradient_checkpointing": True,
                      "gradient_checkpointing_kwargs": {"use_reentrant": False}})
    assert c.gradient_checkpointing_kwargs == {"use_reentrant": False}
    with pytest.raises(ConfigError, match="use_reentrant_gc.*contradicts"):
        build_config({**BASE, "gradient_checkpointing": True, "use_reentrant_gc": True,
                      "gradient_checkpointing_kwargs": {"use_reentrant": False}})


def test_checkpointing_kwargs_are_checked():
    c = build_config({**BASE, "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"reentrant": True}})
    assert any("unknown argument(s) ['reentrant']" in p for p in cross_key_problems(c))
    c = build_config({**BASE, "use_reentrant_gc": False})
    assert any("would have no effect" in p for p in cross_key_problems(c))
    # LLaMA-Factory ignores use_reentrant_gc once checkpointing is disabled; its example files keep both.
    c = build_config({**BASE, "disable_gradient_checkpointing": True, "use_reentrant_gc": True})
    assert not c.gradient_checkpointing and not c.gradient_checkpointing_kwargs and not cross_key_problems(c)


def test_top_level_fsdp_keys_go_into_fsdp_config():
    from shardtune.engines.fsdp_config import resolve_fsdp_settings

    c = build_config({**BASE, "fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 1},
                      "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_min_num_params": 1000})
    settings, problems = resolve_fsdp_settings(c.fsdp, c.fsdp_config)
    assert problems == []
    assert settings.version == 1
    assert settings.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    assert settings.min_num_params == 1000
    with pytest.raises(ConfigError, match="contradicts fsdp_config.min_num_params"):
        build_config({**BASE, "fsdp_config": {"min_num_params": 5}, "fsdp_min_num_params": 1000})
    with pytest.raises(ConfigError, match="put fsdp_min_num_params into that file"):
        build_config({**BASE, "fsdp_config": "fsdp.json", "fsdp_min_num_params": 1000})


@pytest.mark.parametrize(("key", "accepted", "refused", "reason"), [
    ("save_safetensors", True, False, "only as safetensors"),
])
def test_keys_accepted_only_at_what_shardtune_does(key, accepted, refused, reason):
    build_config({**BASE, key: accepted})
    with pytest.raises(ConfigError, match=f"'{key}'.*{reason}"):
        build_config({**BASE, key: refused})


def test_quantization_and_adapter_rules():
    c = build_config({**BASE, "quantization_bit": 4, "quantization_method": "gptq"})
    assert any("quantization_method (gptq)" in p for p in cross_key_problems(c))
    c = build_config({**BASE, "finetuning_type": "full", "adapter_name_or_path": "a"})
    assert any("needs finetuning_type: lora" in p for p in cross_key_problems(c))
    c = build_config({**BASE, "quantization_bit": 4, "adapter_name_or_path": "a,b"})
    assert any("cannot be merged into quantized weights" in p for p in cross_key_problems(c))
    c = build_config({**BASE, "quantization_bit": 4, "adapter_name_or_path": "a"})
    assert cross_key_problems(c) == []
    with pytest.raises(ConfigError, match="quantization_type: 'int4' is not allowed"):
        build_config({**BASE, "quantization_type": "int4"})


def test_logging_first_step_and_run_name_are_keys():
    c = build_config({**BASE, "logging_first_step": True, "run_name": "exp-1", "save_only_model": True})
    assert (c.logging_first_step, c.run_name, c.save_only_model) == (True, "exp-1", True)


# --- quantization: the bitsandbytes object, built without CUDA ---

@pytest.mark.parametrize(("quant_type", "double"), [("nf4", True), ("fp4", False)])
def test_quantization_keys_reach_the_bitsandbytes_config(quant_type, double):
    from shardtune.model.load import Quantization, bitsandbytes_config

    config = bitsandbytes_config(Quantization(4, quant_type, double), torch.bfloat16)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == quant_type
    assert config.bnb_4bit_use_double_quant is double
    assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert bitsandbytes_config(Quantization(8), torch.bfloat16).load_in_8bit


def test_source_passes_the_quantization_keys_on():
    from shardtune.train.settings import finetuning_settings
    from shardtune.train.setup import model_source

    c = build_config({**BASE, "quantization_bit": 4, "quantization_type": "fp4", "double_quantization": False})
    source = model_source(c, finetuning_settings(c))
    assert (source.quantization_bit, source.quantization_type, source.double_quantization) == (4, "fp4", False)


def test_flash_attention_2_is_refused_without_cuda():
    from shardtune.model.load import check_attention

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with pytest.raises(ModelError, match="flash_attention_2.*needs a CUDA GPU"):
        check_attention("flash_attention_2")
    check_attention("eager")


# --- rope_scaling ---

@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    """A tiny LLaMA trained for 64 positions."""
    from shardtune.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "short", max_positions=64)


def rotary_cos(config, positions: torch.Tensor) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, len(positions), 8)
    cos, _ = rotary(x, positions[None])
    return cos[0]


def test_linear_rope_scaling_stretches_positions(short_context_model):
    from shardtune.model.load import load_model_config

    base = load_model_config(str(short_context_model))
    scaled = load_model_config(str(short_context_model), rope_scaling="linear", max_length=130)
    assert scaled.rope_parameters["factor"] == 3.0  # ceil(130 / 64), as LLaMA-Factory computes it
    positions = torch.arange(0, 30, dtype=torch.long)
    torch.testing.assert_close(rotary_cos(scaled, positions * 3), rotary_cos(base, positions))


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "llama3"])
def test_other_rope_types_record_the_trained_context(short_context_model, rope_type):
    from shardtune.model.load import load_model_config

    config = load_model_config(str(short_context_model), rope_scaling=rope_type, max_length=128)
    assert config.rope_parameters["rope_type"] == rope_type and config.rope_parameters["factor"] == 2.0
    assert config.rope_parameters["original_max_position_embeddings"] == 64
    assert config.max_position_embeddings == (128 if rope_type in ("yarn", "llama3") else 64)
    rotary_cos(config, torch.arange(0, 100))  # transformers accepts the settings


def test_rope_scaling_is_skipped_when_cutoff_len_fits(short_context_model, capsys):
    from shardtune.model.load import load_model_config

    config = load_model_config(str(short_context_model), rope_scaling="linear", max_length=64)
    assert config.rope_parameters["rope_type"] == "default"
    assert "not applied" in capsys.readouterr().out


def test_rope_scaling_reaches_the_loaded_model(short_context_model):
    from shardtune.model.finetuning.settings import FinetuningSettings
    from shardtune.model.source import ModelSource

    source = ModelSource(str(short_context_model), FinetuningSettings(), rope_scaling="linear", max_length=128)
    assert source.load_full().config.rope_parameters["factor"] == 2.0
    assert source.build_skeleton().model.config.rope_parameters["factor"] == 2.0


# --- gradient checkpointing arguments ---

def checkpointed_gradients(model_dir, **settings) -> tuple[dict[str, torch.Tensor], object]:
    from shardtune.model.finetuning.settings import FinetuningSettings
    from shardtune.model.source import ModelSource

    torch.manual_seed(0)
    model = ModelSource(str(model_dir), FinetuningSettings(**settings)).load_full()
    ids = torch.arange(1, 33)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, model


@pytest.mark.parametrize("finetuning_type", ["lora", "freeze"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_kwargs_reach_torch_and_keep_gradients(short_context_model, reentrant, finetuning_type):
    plain, _ = checkpointed_gradients(short_context_model, finetuning_type=finetuning_type,
                                      freeze_trainable_layers=1)
    grads, model = checkpointed_gradients(short_context_model, finetuning_type=finetuning_type,
                                          freeze_trainable_layers=1, gradient_checkpointing=True,
                                          checkpointing_kwargs={"use_reentrant": reentrant})
    layer = next(m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func"))
    assert layer._gradient_checkpointing_func.keywords["use_reentrant"] is reentrant
    assert plain.keys() == grads.keys() and plain
    for name in plain:
        assert grads[name].abs().sum() > 0 or plain[name].abs().sum() == 0, name
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-4, atol=1e-6)
