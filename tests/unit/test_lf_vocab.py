"""add_tokens / add_special_tokens (new_special_tokens) / resize_vocab: tokens encode as one id, the embedding and
output layer grow by LLaMA-Factory's rule, the same rows whether the model is loaded whole or filled shard by shard,
LoRA trains and saves both layers, and the saved adapter reloads with the grown vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from shardtune.config.compat import translate_keys
from shardtune.config.load import build_config
from shardtune.engines.sharded_loading import ShardedLoad, fill_fully_sharded
from shardtune.launch.validate import cross_key_problems
from shardtune.model.adapter_files import save_lora_adapter
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.load import load_tokenizer
from shardtune.model.source import ModelSource
from shardtune.model.vocab import VocabGrowth, adapter_embedding_rows, add_new_tokens, grown_tensor, plan_vocab_growth

NEW = ["<tool_call>", "</tool_call>"]


def grown_source(model_dir, finetuning: str, tokenizer_size: int, seed: int = 7) -> ModelSource:
    settings = FinetuningSettings(finetuning_type=finetuning, lora_rank=4, train_embeddings=True)
    return ModelSource(str(model_dir), settings, vocab=plan_vocab_growth(tokenizer_size, 2048, seed))


def test_new_special_tokens_encode_as_one_id_each(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    before = tokenizer("call <tool_call> now")["input_ids"]
    assert add_new_tokens(tokenizer, [], NEW) == 2
    ids = tokenizer("call <tool_call> now")["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids and len(ids) < len(before)
    assert len(tokenizer) == 2050
    assert tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "") == "callnow"  # special: dropped


def test_the_keys_are_read_as_llama_factory_spells_them():
    values, problems = translate_keys({"new_special_tokens": "<a>,<b>", "resize_vocab": True})
    config = build_config(values)
    assert not problems and config.add_special_tokens == ["<a>", "<b>"] and config.resize_vocab
    _, problems = translate_keys({"init_special_tokens": "desc_init"})
    assert problems and "noise_init" in problems[0]
    quantized = build_config({"model_name_or_path": "m", "output_dir": "o", "dataset": "d", "add_tokens": "<x>",
                              "quantization_bit": 4})
    assert any("cannot grow" in p for p in cross_key_problems(quantized))


def test_growth_pads_to_64_and_new_rows_are_the_noisy_mean():
    assert plan_vocab_growth(2050, 2048, 0) == VocabGrowth(2048, 2112, 0)
    assert not plan_vocab_growth(2000, 2048, 0).is_growing
    old = torch.randn(2048, 64)
    grown = grown_tensor(old, VocabGrowth(2048, 2112, 3), 0)
    assert grown.shape == (2112, 64) and torch.equal(grown[:2048], old)
    new = grown[2048:]
    assert (new.mean(0) - old.mean(0)).abs().max() < 4 / math.sqrt(64) / math.sqrt(64)  # centred on the mean
    assert new.std().item() == pytest.approx(1 / math.sqrt(64), rel=0.1)
    assert torch.equal(grown, grown_tensor(old, VocabGrowth(2048, 2112, 3), 0))  # the same on every rank
    assert not torch.equal(new, grown_tensor(old, VocabGrowth(2048, 2112, 3), 1)[2048:])  # lm_head draws its own


def test_lora_trains_the_grown_layers_and_the_shard_fill_matches_the_whole_load(tiny_model_dir):
    torch.manual_seed(0)
    whole = grown_source(tiny_model_dir, "lora", 2050).load_full()
    trainable = {n: p.shape for n, p in whole.named_parameters() if p.requires_grad and ".lora_" not in n}
    assert trainable == {"base_model.model.model.embed_tokens.modules_to_save.default.weight": (2112, 64),
                         "base_model.model.lm_head.modules_to_save.default.weight": (2112, 64)}
    torch.manual_seed(0)
    skeleton = grown_source(tiny_model_dir, "lora", 2050).build_skeleton()
    load = ShardedLoad.start(skeleton, torch.device("cpu"), rank=0, rank0_reads=False)
    fill_fully_sharded(skeleton.model, load, torch.device("cpu"))
    expected = whole.state_dict()
    filled = skeleton.model.state_dict()
    assert filled.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(filled[name], tensor), name


def test_the_saved_adapter_reloads_with_the_grown_vocabulary(tiny_model_dir, tmp_path):
    from peft import PeftModel

    from shardtune.model.load import load_causal_lm

    model = grown_source(tiny_model_dir, "lora", 2050).load_full()
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight[2049].fill_(0.5)  # "trained"
    save_lora_adapter(model, model.state_dict(), tmp_path / "adapter")
    base = load_causal_lm(str(tiny_model_dir))
    rows = adapter_embedding_rows(str(tmp_path / "adapter"), base)
    assert rows == 2112
    base.resize_token_embeddings(rows, mean_resizing=False)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    merged = reloaded.merge_and_unload()
    assert merged.get_output_embeddings().weight.shape == (2112, 64)
    assert torch.all(merged.get_output_embeddings().weight[2049] == 0.5)
    assert torch.equal(merged.get_input_embeddings().weight, model.get_input_embeddings().weight)
