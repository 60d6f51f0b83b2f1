"""Fine-tuning types: trainable parameter counts for LoRA, full and freeze; lora_target errors."""

from __future__ import annotations

import pytest

from shardtune.errors import ConfigError
from shardtune.model.finetuning.apply import apply_finetuning, count_parameters
from shardtune.model.finetuning.settings import FinetuningSettings
from tests.unit.test_loop import tiny_llama

HIDDEN, INTER, LAYERS, VOCAB, KV = 32, 64, 2, 128, 16  # KV: 2 kv heads x head dim 8


def test_full_trains_everything():
    model = apply_finetuning(tiny_llama(), FinetuningSettings(finetuning_type="full"))
    trainable, total = count_parameters(model)
    assert trainable == total


def test_freeze_trains_last_layers_only():
    model = tiny_llama()
    model = apply_finetuning(model, FinetuningSettings(finetuning_type="freeze", freeze_trainable_layers=1))
    trainable, _ = count_parameters(model)
    per_layer = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV) + 3 * HIDDEN * INTER + 2 * HIDDEN
    assert trainable == per_layer
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(n.startswith("model.layers.1.") for n in names)


def test_freeze_selected_modules():
    model = apply_finetuning(tiny_llama(), FinetuningSettings(finetuning_type="freeze", freeze_trainable_layers=2,
                                                              freeze_trainable_modules=("mlp",)))
    trainable, _ = count_parameters(model)
    assert trainable == LAYERS * 3 * HIDDEN * INTER


def test_freeze_too_many_layers_is_an_error():
    with pytest.raises(ConfigError, match="freeze_trainable_layers"):
        apply_finetuning(tiny_llama(), FinetuningSettings(finetuning_type="freeze", freeze_trainable_layers=5))


def test_lora_all_linear_counts():
    r = 4
    model = apply_finetuning(tiny_llama(), FinetuningSettings(lora_rank=r))
    trainable, _ = count_parameters(model)
    # each adapted Linear(in, out) adds r * (in + out)
    per_layer = r * ((HIDDEN + HIDDEN) * 2 + (HIDDEN + KV) * 2 + (HIDDEN + INTER) * 2 + (INTER + HIDDEN))
    assert trainable == LAYERS * per_layer


def test_lora_named_targets_and_unknown_target():
    model = apply_finetuning(tiny_llama(), FinetuningSettings(lora_rank=2, lora_target=("q_proj", "v_proj")))
    trainable, _ = count_parameters(model)
    assert trainable == LAYERS * 2 * ((HIDDEN + HIDDEN) + (HIDDEN + KV))
    with pytest.raises(ConfigError, match="q_prj not found.*q_proj"):
        apply_finetuning(tiny_llama(), FinetuningSettings(lora_target=("q_prj",)))


def test_quantization_without_cuda_is_a_clear_error():
    import torch

    from shardtune.errors import ModelError
    from shardtune.model.load import Quantization, quantization_config

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with pytest.raises(ModelError, match="needs a CUDA GPU"):
        quantization_config(Quantization(4), torch.bfloat16)


def checkpoint_arguments(model) -> list[dict]:
    """The torch.utils.checkpoint arguments each checkpointed decoder layer calls it with."""
    return [dict(m._gradient_checkpointing_func.keywords) for m in model.modules()
            if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]


@pytest.mark.parametrize("quantized", [False, True])
def test_checkpointing_keeps_its_arguments_under_qlora(quantized):
    """peft's prepare_model_for_kbit_training enables checkpointing again; it must keep use_reentrant: false and
    the user's gradient_checkpointing_kwargs (here an extra torch.utils.checkpoint argument)."""
    model = tiny_llama()
    model.is_loaded_in_4bit = quantized  # what bitsandbytes' loading sets; peft's k-bit path reads it
    settings = FinetuningSettings(gradient_checkpointing=True, checkpointing_kwargs={"preserve_rng_state": False},
                                  is_quantized=quantized)
    found = checkpoint_arguments(apply_finetuning(model, settings))
    assert len(found) >= LAYERS  # the decoder layers (and the model, which carries the flag too)
    assert all(kwargs == {"use_reentrant": False, "preserve_rng_state": False} for kwargs in found), found
