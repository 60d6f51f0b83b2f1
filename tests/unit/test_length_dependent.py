"""Weights the loss reaches only on long rows (model/length_dependent.py): kept in the graph of every micro-batch.

DeepSeek-V4's heavily compressed attention uses its compressor only for rows of 128 tokens or more; before, two
ranks with rows of different lengths reduced gradients of different sizes (ZeRO-3 and FSDP2 aborted) and DDP's
probe froze the compressor. Every family of transformers' registry is probed at a short and a long length: with
the hooks in place, no weight may be reached by the long row and not by the short one (a new family with such a
module fails here until its class joins the table).
"""

from __future__ import annotations

import pytest
import torch

from shardtune.model.gradient_probe import ProbeFailed, parameters_without_gradient
from shardtune.model.length_dependent import keep_length_dependent_in_graph
from shardtune.model.registry import decoder_families, tiny_registry_config

SHORT, LONG = 16, 512
MAX_PARAMETERS = 30_000_000  # scripts/registry_engines.py's bound: configs that do not shrink are not built
VOCAB = 512
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # ids the tiny vocabulary holds


def tiny_model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_registry_config(family, VOCAB, SPECIAL_IDS)
        with torch.device("meta"):
            count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        torch.manual_seed(0)
        model = None if count > MAX_PARAMETERS else AutoModelForCausalLM.from_config(config)
    except Exception as error:  # noqa: BLE001 - tests/unit/test_registry_families.py pins which cannot be built
        pytest.skip(f"{family}: the tiny config cannot be built ({type(error).__name__})")
    if model is None:
        pytest.skip(f"{family}: {count:,} parameters after shrinking")
    return model


def long_length(model: torch.nn.Module) -> int:
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    # half the table: RoBERTa-style positions start after the padding id
    return min(LONG, positions // 2) if isinstance(positions, int) and positions > 2 * SHORT else LONG


def test_the_compressor_gets_zero_gradients_on_a_short_row_and_the_logits_do_not_change():
    model = tiny_model("deepseek_v4")
    ids = (torch.arange(SHORT) % VOCAB).unsqueeze(0)
    before = model(input_ids=ids).logits.detach()
    assert keep_length_dependent_in_graph(model) == ["model.layers.0.self_attn.compressor"]
    assert keep_length_dependent_in_graph(model) == []  # hooked once
    out = model(input_ids=ids).logits
    assert torch.equal(out.detach(), before)
    out.float().pow(2).mean().backward()
    compressor = model.model.layers[0].self_attn.compressor
    for name, weight in compressor.named_parameters():
        assert weight.grad is not None, name
        assert weight.grad.shape == weight.shape and not weight.grad.any(), name


def test_a_long_row_trains_the_compressor_as_before():
    model = tiny_model("deepseek_v4")
    ids = (torch.arange(256) % VOCAB).unsqueeze(0)
    keep_length_dependent_in_graph(model)
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    assert model.model.layers[0].self_attn.compressor.kv_proj.weight.grad.abs().sum() > 0


def test_ddp_probe_no_longer_freezes_the_compressor():
    model = tiny_model("deepseek_v4")
    keep_length_dependent_in_graph(model)
    unreached = parameters_without_gradient(model, torch.device("cpu"))
    assert not [name for name in unreached if ".compressor." in name and ".indexer." not in name]
    assert any(".indexer." in name for name in unreached)  # the sparse indexer's top-k: structurally unused


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", decoder_families())  # all of them: about 15 s on 2 cores
def test_no_weight_of_a_registry_family_depends_on_the_row_length(family):
    model = tiny_model(family)
    hooked = keep_length_dependent_in_graph(model)
    try:
        short = set(parameters_without_gradient(model, torch.device("cpu"), tokens=SHORT))
        long = set(parameters_without_gradient(model, torch.device("cpu"), tokens=long_length(model)))
    except ProbeFailed as failure:
        pytest.skip(f"{family}: its forward needs more than token ids ({failure})")
    only_long = sorted(short - long)
    assert not only_long, (f"{family}: reached only by a row of {long_length(model)} tokens: {only_long[:4]}; add "
                           f"the owning module's class to model/length_dependent.py's table (hooked: {hooked})")
