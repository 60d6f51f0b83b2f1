"""adapter_name_or_path / create_new_adapter: earlier adapters are merged into the base or trained further."""

from __future__ import annotations

import pytest
import torch

from shardtune.errors import ModelError
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.pretrained_adapters import plan_adapters
from shardtune.model.source import ModelSource

Q_PROJ = "model.layers.0.self_attn.q_proj"


def make_adapter(model_dir, out, seed: int, rank: int):
    """A LoRA adapter with non-zero B (as after training), saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir)),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(str(out))
    return {n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    first = make_adapter(tiny_model_dir, root / "a", seed=1, rank=4)
    second = make_adapter(tiny_model_dir, root / "b", seed=2, rank=2)
    return {"a": (str(root / "a"), first), "b": (str(root / "b"), second)}


def source(model_dir, paths: tuple[str, ...], create_new: bool = False) -> ModelSource:
    plan = plan_adapters(paths, create_new)
    return ModelSource(str(model_dir), FinetuningSettings(resume_adapter=plan.to_resume), adapters=plan)


def lora_weights(model) -> dict[str, torch.Tensor]:
    return {n.replace(".default", ""): p.detach() for n, p in model.named_parameters() if "lora_" in n}


def base_weight(model) -> torch.Tensor:
    return dict(model.named_parameters())[f"base_model.model.{Q_PROJ}.base_layer.weight"].detach()


def delta(saved: dict[str, torch.Tensor], rank: int) -> torch.Tensor:
    a = saved[f"base_model.model.{Q_PROJ}.lora_A.weight"]
    b = saved[f"base_model.model.{Q_PROJ}.lora_B.weight"]
    return b @ a * (2 * rank / rank)


def test_one_adapter_trains_on_with_its_own_settings(tiny_model_dir, adapters):
    path, saved = adapters["a"]
    model = source(tiny_model_dir, (path,)).load_full()
    loaded = lora_weights(model)
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    assert model.peft_config["default"].r == 4  # the adapter's rank, not lora_rank's default 8


def test_all_but_the_last_adapter_are_merged(tiny_model_dir, adapters):
    from safetensors.torch import load_file

    original = load_file(str(tiny_model_dir / "model.safetensors"))[f"{Q_PROJ}.weight"]
    (path_a, saved_a), (path_b, saved_b) = adapters["a"], adapters["b"]
    model = source(tiny_model_dir, (path_a, path_b)).load_full()
    torch.testing.assert_close(base_weight(model), original + delta(saved_a, 4), rtol=1e-5, atol=1e-6)
    for name, value in saved_b.items():
        torch.testing.assert_close(lora_weights(model)[name], value)


def test_create_new_adapter_merges_every_adapter_and_starts_fresh(tiny_model_dir, adapters):
    from safetensors.torch import load_file

    original = load_file(str(tiny_model_dir / "model.safetensors"))[f"{Q_PROJ}.weight"]
    path_a, saved_a = adapters["a"]
    model = source(tiny_model_dir, (path_a,), create_new=True).load_full()
    torch.testing.assert_close(base_weight(model), original + delta(saved_a, 4), rtol=1e-5, atol=1e-6)
    fresh = lora_weights(model)
    assert all(v.abs().sum() == 0 for n, v in fresh.items() if "lora_B" in n)
    assert model.peft_config["default"].r == 8


def test_sharding_engines_resume_an_adapter_but_cannot_merge(tiny_model_dir, adapters):
    path_a, saved_a = adapters["a"]
    skeleton = source(tiny_model_dir, (path_a,)).build_skeleton()
    initial = {n.replace(".default", ""): v for n, v in skeleton.initial_values().items()}
    for name, value in saved_a.items():
        torch.testing.assert_close(initial[name], value)
    with pytest.raises(ModelError, match="merging 1 adapter"):
        source(tiny_model_dir, (path_a, adapters["b"][0])).build_skeleton()


def test_a_folder_without_adapter_config_is_refused_before_work(tiny_model_dir, tmp_path):
    from shardtune.config.load import build_config
    from shardtune.launch.validate import file_problems

    c = build_config({"model_name_or_path": str(tiny_model_dir), "dataset": "demo", "output_dir": str(tmp_path),
                      "adapter_name_or_path": f"{tiny_model_dir}"})
    assert any("not a peft adapter folder" in p for p in file_problems(c))
