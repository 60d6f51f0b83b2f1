"""LLaMA-Pro: `shardtune expand-model` inserts zero-output copies of decoder layers (the model computes what it
did), and ``use_llama_pro: true`` trains only those blocks, under freeze and LoRA, as LLaMA-Factory chooses them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from shardtune.errors import ConfigError
from shardtune.model.finetuning.apply import apply_finetuning
from shardtune.model.finetuning.freeze import trainable_layer_ids
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.llama_pro import expansion_sources
from tests.conftest import run_cli


def test_blocks_are_inserted_after_every_split_and_trained_there():
    assert expansion_sources(4, 2) == [0, 1, 1, 2, 3, 3]
    assert expansion_sources(4, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    # The expanded model's trainable blocks are exactly the inserted ones (LLaMA-Factory's stride rule).
    for layers, expand in ((4, 2), (4, 4), (6, 3)):
        sources = expansion_sources(layers, expand)
        inserted = [i for i in range(1, len(sources)) if sources[i] == sources[i - 1]]
        assert trainable_layer_ids(len(sources), expand, llama_pro=True) == inserted
    with pytest.raises(ConfigError, match="must divide"):
        expansion_sources(4, 3)
    with pytest.raises(ConfigError, match="divides the model's 6 layers"):
        trainable_layer_ids(6, 4, llama_pro=True)
    assert trainable_layer_ids(6, 2) == [4, 5] and trainable_layer_ids(6, -2) == [0, 1]


@pytest.fixture(scope="module")
def expanded(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-pro")
    base, out = root / "base", root / "expanded"
    assert run_cli("make-tiny-model", "--out", str(base), "--layers", "4").returncode == 0
    done = run_cli("expand-model", str(base), "--out", str(out), "--num-expand", "2")
    assert done.returncode == 0, done.stderr
    return base, out


def test_the_expanded_model_computes_what_the_original_did(expanded):
    from transformers import AutoModelForCausalLM

    base, out = expanded
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 6
    assert (out / "tokenizer.json").is_file()
    ids = torch.randint(5, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits
        after = AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    weights = load_file(out / "model.safetensors")
    assert not weights["model.layers.2.self_attn.o_proj.weight"].any()
    assert weights["model.layers.1.self_attn.o_proj.weight"].any()


@pytest.mark.parametrize("finetuning", ["freeze", "lora"])
def test_only_the_inserted_blocks_train(expanded, finetuning):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(expanded[1])
    model = apply_finetuning(model, FinetuningSettings(finetuning_type=finetuning, freeze_trainable_layers=2,
                                                       llama_pro=True, lora_target=("all",)))
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    layers = {int(name.split(".layers.")[1].split(".")[0]) for name in trained}
    assert trained and layers == {2, 5}
    if finetuning == "lora":
        assert all("lora_" in name for name in trained)


def test_check_refuses_what_llama_pro_cannot_train(expanded):
    base, out = expanded
    common = ("examples/tiny/sft_lora.yaml", f"model_name_or_path={out}", "build_tiny_model_if_missing=false",
              "use_llama_pro=true")
    full = run_cli("check", *common, "finetuning_type=full")
    assert full.returncode == 2 and "use_llama_pro (true) trains the expanded blocks" in full.stderr
    uneven = run_cli("check", *common, "finetuning_type=freeze", "freeze_trainable_layers=4")
    assert uneven.returncode == 2 and "divides the model's 6 layers" in uneven.stderr
    assert run_cli("check", *common, "finetuning_type=freeze", "freeze_trainable_layers=2").returncode == 0


@pytest.mark.e2e
def test_a_llama_pro_run_changes_only_the_new_blocks(expanded, tmp_path):
    out = tmp_path / "run"
    done = run_cli("train", "examples/tiny/sft_full.yaml", f"model_name_or_path={expanded[1]}",
                   "build_tiny_model_if_missing=false", f"output_dir={out}", "finetuning_type=freeze",
                   "use_llama_pro=true", "freeze_trainable_layers=2", "max_steps=2", "save_strategy=no",
                   "do_eval=false", "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=16")
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = load_file(expanded[1] / "model.safetensors"), load_file(out / "model.safetensors")
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(".layers.2." in name or ".layers.5." in name for name in changed)
