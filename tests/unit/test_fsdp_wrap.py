"""Which modules get their own FSDP unit, for families of transformers' registry the hand-written table does not
list (the registry matrix found both: FSDP2 refused the model before its first step)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from shardtune.engines.engine_plan import FsdpSettings
from shardtune.engines.fsdp_wrap import wrap_targets
from shardtune.model.registry import tiny_registry_config


def tiny(model_type: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_registry_config(model_type, 512))


def test_a_model_without_no_split_modules_wraps_its_layer_stack():
    model = tiny("biogpt")  # BioGPT declares no _no_split_modules
    assert not getattr(model, "_no_split_modules", None)
    units = wrap_targets(model, FsdpSettings())
    assert [type(unit).__name__ for unit in units] == ["BioGptDecoderLayer"] * len(model.biogpt.layers)


def test_a_module_holding_a_tied_weight_stays_in_its_parent_unit():
    model = tiny("bert")  # BertEmbeddings is a no-split module; its word embeddings are the output layer's weight
    assert model.bert.embeddings.word_embeddings.weight is model.cls.predictions.decoder.weight
    names = {type(unit).__name__ for unit in wrap_targets(model, FsdpSettings())}
    assert names == {"BertLayer"}


def test_a_unit_nested_in_another_is_sharded_first():
    model = tiny("falcon_mamba")  # FalconMambaMixer (inside FalconMambaBlock) is a no-split class too
    order = [type(unit).__name__ for unit in wrap_targets(model, FsdpSettings())]
    assert order == ["FalconMambaMixer"] * 2 + ["FalconMambaBlock"] * 2
