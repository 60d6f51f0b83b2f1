"""LLaMA-Factory's adapter keys, honoured with its meaning: DoRA, rsLoRA, PiSSA (+ conversion), LoRA+,
additional_target, lora_alpha's default (BAdam and the other optimizer replacements: tests/unit/test_badam.py,
tests/unit/test_lf_optimizers.py)."""

from __future__ import annotations

import pytest
import torch

from shardtune.config.load import build_config
from shardtune.engines.plan import plan_engine
from shardtune.errors import ConfigError
from shardtune.launch.validate import cross_key_problems
from shardtune.model.adapter_files import save_lora_adapter
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.source import ModelSource
from shardtune.optim.build import build_optimizer, parameter_names
from shardtune.optim.settings import OptimizerSettings
from shardtune.train.settings import finetuning_settings

TARGETS = ("q_proj", "v_proj")


def _lora(model_dir, **settings) -> torch.nn.Module:
    torch.manual_seed(0)
    return ModelSource(str(model_dir), FinetuningSettings(lora_target=TARGETS, **settings)).load_full()


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 2048, (2, 12), generator=generator)}


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


# --- config: accepted, translated, refused ---

def test_keys_are_accepted_and_reach_the_settings():
    config = build_config({"use_dora": True, "use_rslora": True, "pissa_init": True, "pissa_iter": -1,
                           "additional_target": "embed_tokens,lm_head", "neftune_noise_alpha": 5})
    settings = finetuning_settings(config)
    assert (settings.use_dora, settings.use_rslora, settings.pissa_init) == (True, True, True)
    assert settings.init_lora_weights == "pissa"
    assert settings.additional_target == ("embed_tokens", "lm_head")
    assert settings.neftune_noise_alpha == 5
    assert FinetuningSettings(pissa_init=True).init_lora_weights == "pissa_niter_16"  # LLaMA-Factory's default



def test_lora_only_keys_are_refused_with_other_methods():
    problems = cross_key_problems(build_config({"finetuning_type": "full", "use_dora": True, "loraplus_lr_ratio": 16,
                                                "model_name_or_path": "m", "output_dir": "o", "dataset": "d"}))
    assert any(p.startswith("use_dora (True)") for p in problems)
    assert any(p.startswith("loraplus_lr_ratio (16.0)") for p in problems)
    problems = cross_key_problems(build_config({"pissa_convert": True, "model_name_or_path": "m", "output_dir": "o",
                                                "dataset": "d"}))
    assert any("pissa_convert (true) needs pissa_init" in p for p in problems)


@pytest.mark.parametrize(("engine", "key", "refused"), [
    ({"fsdp": "full_shard auto_wrap"}, "pissa_init", True),
    ({"deepspeed": "z3"}, "pissa_init", True),
    ({"deepspeed": "z2"}, "pissa_init", False),
    ({"deepspeed": "z3"}, "use_dora", True),
    ({"fsdp": "full_shard auto_wrap"}, "use_dora", False),
])
def test_engine_combinations_that_cannot_build_are_refused_before_launch(engine, key, refused):
    _, problems = plan_engine(build_config({**engine, key: True}), world_size=2, has_cuda=False)
    assert any(p.startswith(f"{key} (true)") for p in problems) == refused


# --- effects on the model ---

def test_lora_alpha_defaults_to_twice_the_rank_and_rslora_divides_by_sqrt_rank(tiny_model_dir):
    plain = _lora_layers(_lora(tiny_model_dir, lora_rank=4))
    assert plain and all(m.scaling["default"] == pytest.approx(2.0) for m in plain)  # alpha 8 / rank 4
    rs = _lora_layers(_lora(tiny_model_dir, lora_rank=4, use_rslora=True))
    assert all(m.scaling["default"] == pytest.approx(8 / 4 ** 0.5) for m in rs)


def test_dora_adds_a_trained_magnitude_equal_to_the_base_row_norms(tiny_model_dir):
    model = _lora(tiny_model_dir, use_dora=True)
    layers = _lora_layers(model)
    for layer in layers:
        magnitude = layer.lora_magnitude_vector["default"].weight
        assert magnitude.requires_grad
        torch.testing.assert_close(magnitude, torch.linalg.norm(layer.base_layer.weight, dim=1))
    assert not any("magnitude" in n for n, _ in _lora(tiny_model_dir).named_parameters())
    # The magnitude changes the function once it trains: scaling it scales the layer's output.
    batch = _batch()
    with torch.no_grad():
        before = model(**batch).logits
        for layer in layers:
            layer.lora_magnitude_vector["default"].weight.mul_(1.5)
        assert not torch.allclose(model(**batch).logits, before)


def test_skeleton_gets_the_same_dora_magnitudes_and_additional_target_copies_from_the_files(tiny_model_dir):
    source = ModelSource(str(tiny_model_dir), FinetuningSettings(lora_target=TARGETS, use_dora=True,
                                                                 additional_target=("embed_tokens",)))
    full = source.load_full()
    skeleton = source.build_skeleton()
    initial = skeleton.initial_values()
    magnitudes = {n: p for n, p in full.named_parameters() if "lora_magnitude_vector" in n}
    assert magnitudes
    for name, value in magnitudes.items():
        torch.testing.assert_close(initial[name], value)
    copy = "base_model.model.model.embed_tokens.modules_to_save.default.weight"
    assert skeleton.checkpoint_names[copy] == "model.embed_tokens.weight"


def test_additional_target_trains_the_module_in_full_and_saves_it_with_the_adapter(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = _lora(tiny_model_dir, additional_target=("embed_tokens",))
    copy = dict(model.named_parameters())["base_model.model.model.embed_tokens.modules_to_save.default.weight"]
    assert copy.requires_grad
    with torch.no_grad():
        copy.add_(0.01)
    for out, save in ((tmp_path / "peft", lambda d: model.save_pretrained(d)),
                      (tmp_path / "ours", lambda d: save_lora_adapter(model, model.state_dict(), d))):
        save(out)
        with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
            assert "base_model.model.model.embed_tokens.weight" in f.keys()
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
        torch.testing.assert_close(loaded.get_input_embeddings().weight, copy.detach())
    with pytest.raises(ConfigError, match="additional_target: nonexistent"):
        _lora(tiny_model_dir, additional_target=("nonexistent",))


def test_pissa_keeps_the_function_and_pissa_convert_writes_a_lora_of_the_original_model(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.train.pissa import CONVERTED_DIR, PissaConversion

    batch = _batch()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        expected = base(**batch).logits
    model = _lora(tiny_model_dir, pissa_init=True, pissa_iter=-1)
    layer = _lora_layers(model)[0]
    assert layer.lora_B["default"].weight.abs().sum() > 0  # singular vectors, not LoRA's zero start
    assert not torch.allclose(layer.base_layer.weight, base.model.layers[0].self_attn.q_proj.weight)  # residual
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected, atol=1e-4, rtol=1e-4)
    conversion = PissaConversion.start(model, tmp_path, is_main=True)
    with torch.no_grad():  # "training": move every adapter matrix
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.02 * torch.randn_like(param))
        trained = model(**batch).logits
    conversion.save_converted(model, is_main=True)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    converted = PeftModel.from_pretrained(original, tmp_path / CONVERTED_DIR)
    assert converted.peft_config["default"].r == 2 * 8
    with torch.no_grad():
        torch.testing.assert_close(converted(**batch).logits, trained, atol=1e-4, rtol=1e-4)


# --- LoRA+ ---

def test_loraplus_gives_lora_b_the_ratio_in_the_param_groups_and_in_one_step(tiny_model_dir):
    model = _lora(tiny_model_dir, use_dora=True)
    params = [p for p in model.parameters() if p.requires_grad]
    settings = OptimizerSettings(optim="sgd", learning_rate=0.1, loraplus_lr_ratio=16)
    optimizer = build_optimizer(params, settings, parameter_names(model))
    names = parameter_names(model)
    rates = {names[id(p)]: group["lr"] for group in optimizer.param_groups for p in group["params"]}
    assert len(rates) == len(params)
    for name, rate in rates.items():
        high = "lora_B" in name or "lora_magnitude_vector" in name
        assert rate == pytest.approx(1.6 if high else 0.1), name
    for param in params:
        param.grad = torch.ones_like(param)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer.step()
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(before[name] - param.detach(), torch.full_like(param, rates[name]))
    plain = build_optimizer(params, OptimizerSettings(optim="sgd", learning_rate=0.1), parameter_names(model))
    assert {g["lr"] for g in plain.param_groups} == {0.1}


def test_loraplus_embedding_rate_applies_to_lora_embedding_b():
    from shardtune.optim.build import loraplus_groups

    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(3, 2))
    names = {id(a): "x.lora_embedding_A.default", id(b): "x.lora_embedding_B.default"}
    groups = loraplus_groups([a, b], names, OptimizerSettings(learning_rate=1e-3, loraplus_lr_ratio=4,
                                                              loraplus_lr_embedding=5e-6))
    assert {id(p): g["lr"] for g in groups for p in g["params"]} == {id(a): 1e-3, id(b): 5e-6}


@pytest.mark.e2e
def test_pissa_convert_through_the_cli_writes_a_lora_of_the_original_model(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.conftest import run_cli

    result = run_cli("train", "examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}",
                     f"output_dir={tmp_path}", "finetuning_type=lora", "lora_target=q_proj,v_proj", "max_steps=3",
                     "save_strategy=no", "do_eval=false", "eval_strategy=no", "val_size=0", "plot_loss=false",
                     "max_samples=40", "pissa_init=true", "pissa_iter=-1", "pissa_convert=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "pissa_init" / "adapter_model.safetensors").is_file()
    batch = _batch()
    # The PiSSA adapter needs its residual base: peft rebuilds it from the original weights on load (exact SVD).
    pissa = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)
    converted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                          tmp_path / "pissa_converted")
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        expected = pissa(**batch).logits
        torch.testing.assert_close(converted(**batch).logits, expected, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(plain(**batch).logits, expected, atol=1e-4)  # training moved the adapter
