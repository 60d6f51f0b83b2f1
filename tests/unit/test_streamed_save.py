"""A model written one module at a time (ZeRO-3 without a consolidated state dict) equals save_pretrained's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from shardtune.engines.deepspeed_save import INDEX_FILE, plain_module_states, write_model_streamed


def tiny(model_type: str, tied: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  vocab_size=96, num_experts=4, num_experts_per_tok=2,
                                  tie_word_embeddings=tied)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def saved_keys(folder) -> set[str]:
    keys = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            keys.update(handle.keys())
    return keys


@pytest.mark.parametrize(("model_type", "tied"), [("llama", False), ("llama", True), ("qwen3_moe", False)])
def test_streamed_shards_reload_as_the_model_and_match_save_pretrained(model_type, tied, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny(model_type, tied)
    files = write_model_streamed(model, plain_module_states(model), tmp_path / "streamed", max_shard_bytes=40_000)
    model.save_pretrained(tmp_path / "reference")
    assert len(files) > 2, "the small shard size should split the model"
    index = json.loads((tmp_path / "streamed" / INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(f.name for f in files)
    # Same tensor names as save_pretrained: tied weights once, MoE experts in the checkpoint's per-expert form.
    assert saved_keys(tmp_path / "streamed") == saved_keys(tmp_path / "reference") == set(index["weight_map"])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    expected = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


def test_a_model_that_fits_one_shard_is_a_single_file(tmp_path):
    model = tiny("llama", False)
    write_model_streamed(model, plain_module_states(model), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json",
                                                          "model.safetensors"]
