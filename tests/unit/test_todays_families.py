"""What this year's families need from shardtune, each checked on a tiny model of the family built from
transformers' registry (model/registry.py): the sharding engines' reader applies transformers' checkpoint
conversion, DDP freezes what the LM loss never reaches, ``lora_target: all`` leaves out what LoRA cannot adapt,
and packing passes the launch check where layers carry a state along the row (they run once per packed sample:
model/packed_state.py, tests/unit/test_packed_state.py)."""

from __future__ import annotations

import types

import pytest
import torch

from shardtune.errors import ConfigError


def load(folder):
    from shardtune.model.load import load_causal_lm

    return load_causal_lm(str(folder))


# --- transformers' checkpoint conversion, read tensor by tensor ---

@pytest.mark.parametrize(("family", "converted"), [
    ("kimi_linear", "model.layers.0.self_attn.conv1d.weight"),  # q/k/v short convolutions concatenated
    ("granitemoe", "model.layers.0.block_sparse_moe.experts.gate_up_proj"),  # regex rename
    ("registry:gemma3", "model.language_model.layers.0.self_attn.q_proj.weight"),  # an image-text folder's prefix
    ("hrm_text", "model.L_module.layers.0.self_attn.q_proj.weight"),  # one stored tensor split in several
])
def test_converted_tensors_read_from_the_files_equal_from_pretrained(family, converted, arch_model_dir):
    from shardtune.model.conversion import ConvertedReader, converted_weights
    from shardtune.model.weights import open_weights

    folder = arch_model_dir(family)
    model = load(folder)
    reader = converted_weights(open_weights(folder), model)
    assert isinstance(reader, ConvertedReader)
    state = model.state_dict()
    assert converted in state and converted not in reader.files  # the model's name, not one in the files
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # a tied head once, as the embedding
    for key, value in state.items():
        if key not in tensors or (key == "lm_head.weight" and model.config.get_text_config().tie_word_embeddings):
            continue
        assert key in reader, key
        torch.testing.assert_close(reader.read(key), value, rtol=0, atol=0, msg=key)
    full = state[converted]
    offsets = tuple(1 if size > 2 else 0 for size in full.shape)
    shape = tuple(size - offset for size, offset in zip(full.shape, offsets, strict=True))
    block = full[tuple(slice(o, None) for o in offsets)]
    torch.testing.assert_close(reader.read_slice(converted, offsets, shape), block, rtol=0, atol=0)


def test_a_checkpoint_without_conversion_is_read_as_it_is(arch_model_dir):
    from shardtune.model.conversion import converted_weights
    from shardtune.model.weights import open_weights

    weights = open_weights(arch_model_dir("llama"))
    assert converted_weights(weights, load(arch_model_dir("llama"))) is weights


# --- parameters the LM loss never reaches (DDP) ---

def test_the_probe_finds_the_sparse_attention_indexer_and_nothing_else(arch_model_dir):
    from shardtune.model.gradient_probe import parameters_without_gradient

    model = load(arch_model_dir("deepseek_v32")).train()
    unreached = parameters_without_gradient(model, torch.device("cpu"))
    assert unreached and all(".indexer." in name for name in unreached), unreached
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert parameters_without_gradient(load(arch_model_dir("llama")), torch.device("cpu")) == []


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_probe_sees_through_activation_checkpointing(reentrant, arch_model_dir):
    from shardtune.model.gradient_probe import parameters_without_gradient

    model = load(arch_model_dir("llama"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    assert parameters_without_gradient(model, torch.device("cpu")) == []


def test_the_probe_draws_no_random_numbers(arch_model_dir):
    from shardtune.model.gradient_probe import parameters_without_gradient

    model = load(arch_model_dir("deepseek_v32"))
    before = torch.random.get_rng_state()
    parameters_without_gradient(model, torch.device("cpu"))
    assert torch.equal(before, torch.random.get_rng_state())


class ForwardThatFails(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.config = types.SimpleNamespace(vocab_size=8)

    def forward(self, input_ids, **inputs):
        raise ValueError("needs pixel_values\nsecond line")


def test_a_probe_whose_forward_fails_says_so_instead_of_reporting_nothing_unreached():
    from shardtune.model.gradient_probe import ProbeFailed, parameters_without_gradient

    with pytest.raises(ProbeFailed, match=r"^ValueError: needs pixel_values$"):
        parameters_without_gradient(ForwardThatFails(), torch.device("cpu"))


def test_ddp_searches_for_unused_parameters_when_the_probe_fails(capsys):
    from shardtune.engines.base import PrecisionSettings
    from shardtune.engines.ddp import DDPEngine
    from shardtune.engines.distributed import DistContext

    ctx = DistContext(rank=0, local_rank=0, world_size=2, local_world_size=2, device=torch.device("cpu"),
                      backend="gloo")
    model = ForwardThatFails()
    assert DDPEngine(PrecisionSettings(), ctx)._freeze_unreached(model) is True
    assert model.weight.requires_grad
    assert "probe forward that finds parameters without a gradient failed (ValueError: needs pixel_values)" in \
        capsys.readouterr().out


# --- lora_target: all on modules LoRA cannot adapt ---

@pytest.mark.parametrize(("family", "left_out", "kept"), [
    ("nemotron_h", "out_proj", "in_proj"),  # peft refuses Mamba's out_proj
    ("deepseek_v4", "o_a_proj", "o_b_proj"),  # a grouped Linear: its input is wider than its weight
    ("gemma3n_text", "correction_coefs", "altup_projections.0"),  # its weight read directly in training
])
def test_lora_all_leaves_out_what_lora_cannot_adapt(family, left_out, kept, arch_model_dir, capsys):
    from shardtune.model.finetuning.targets import lora_targets

    targets = lora_targets(load(arch_model_dir(family)), ("all",))
    assert left_out not in targets.modules and kept in targets.modules
    said = capsys.readouterr().out
    assert "lora_target (all): not adapted:" in said and f"{left_out} (" in said


def test_a_list_index_is_no_bare_lora_target_name():
    from shardtune.model.finetuning.targets import short_module_name

    assert short_module_name("model.altup_projections.0") == "altup_projections.0"  # "0" names every first layer
    assert short_module_name("model.layers.0.self_attn.q_proj") == "q_proj"


def test_zero3_gathers_modules_that_call_a_submodule_once_per_position_whole(arch_model_dir):
    pytest.importorskip("deepspeed")
    from deepspeed.utils import z3_leaf_module

    from shardtune.engines.deepspeed import apply_zero3_moe_leaves

    model = load(arch_model_dir("qwen4_exp_text"))
    assert "Qwen4ExpTextQSAIndexer" in apply_zero3_moe_leaves(model)
    assert any(z3_leaf_module(m) for m in model.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer")


def test_lora_all_keeps_a_plain_linear_reimplementation(arch_model_dir):
    from shardtune.model.finetuning.targets import lora_targets

    assert lora_targets(load(arch_model_dir("falcon")), ("all",)).modules == "all-linear"  # FalconLinear


def test_lora_naming_a_module_lora_cannot_adapt_is_refused_with_the_reason(arch_model_dir):
    from shardtune.model.finetuning.targets import lora_targets

    with pytest.raises(ConfigError, match=r"lora_target \(out_proj\): LoRA cannot adapt it: peft refuses it"):
        lora_targets(load(arch_model_dir("nemotron_h")), ("q_proj", "out_proj"))


# --- packed rows and layers with a state ---

@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_packing_passes_the_launch_check_for_layers_with_a_state_under_every_kernel(family, arch_model_dir):
    import json

    from shardtune.model.attention import kernel_support, packing_problem

    config = json.loads((arch_model_dir(family) / "config.json").read_text())
    for kernel in ("sdpa", "eager", "flash_attention_2"):
        assert packing_problem(config, kernel_support(config), kernel, family) is None


def test_packing_stays_refused_for_a_state_space_model_that_builds_its_own_mask(arch_model_dir):
    import json

    from shardtune.model.attention import kernel_support, packing_problem

    config = json.loads((arch_model_dir("mamba") / "config.json").read_text())
    problem = packing_problem(config, kernel_support(config), "sdpa", "mamba")
    assert problem and "builds its attention mask itself" in problem and "packing: false" in problem


def test_padding_free_is_on_for_a_model_with_state_space_layers(arch_model_dir, tmp_path):
    from shardtune.config.schema import TrainConfig
    from shardtune.train.setup import padding_free_rows

    config = TrainConfig(model_name_or_path=str(arch_model_dir("nemotron_h")), stage="sft", dataset="demo",
                         output_dir=str(tmp_path))
    assert padding_free_rows(config) is True  # its Mamba blocks run once per sample of the row
    dense = TrainConfig(model_name_or_path=str(arch_model_dir("llama")), stage="sft", dataset="demo",
                        output_dir=str(tmp_path), padding_free=True)
    assert padding_free_rows(dense) is True


@pytest.mark.parametrize(("config", "said"), [
    ({"model_type": "gemma4_assistant"}, "a draft model for Gemma 4's speculative decoding"),
    ({"model_type": "reformer"}, "Reformer trains only on rows exactly as long as its axial position table"),
    ({"model_type": "musicgen"}, "a text-to-music model"),
    ({"model_type": "gemma3n", "vision_config": {"model_type": "gemma3n_vision"}}, "timm is not installed"),
])
def test_families_that_cannot_be_fine_tuned_are_refused_from_their_config(config, said, tmp_path, monkeypatch):
    import importlib.util
    import json

    from shardtune.model.folder import model_folder_problems

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else found(name, *a))
    (tmp_path / "config.json").write_text(json.dumps(config))
    problems = model_folder_problems(tmp_path)
    assert said in problems[0], problems
