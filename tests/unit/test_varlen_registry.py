"""Every decoder family of the installed transformers under ``attn_implementation: varlen`` with packed rows:
either shardtune's checks refuse the family (before launch, with the reason), or each packed sample's logits equal
the sample run alone under eager attention. A family that ignores the offsets (its samples would see each other)
or drops its sliding window (16 tokens here, samples up to 30: test_packing_architectures.py's rows) cannot
pass.

Every family runs in `make test`: 176 with transformers 5.23, about 25 s on 2 CPU cores.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardtune.data.collator import DataCollator
from shardtune.model.attention import (
    kernel_problem,
    kernel_support,
    layer_windows,
    packing_problem,
    stateful_layer_kinds,
)
from shardtune.model.packed_state import apply_sample_boundaries
from shardtune.model.registry import decoder_families, tiny_registry_config
from shardtune.model.varlen import VARLEN, register_varlen
from tests.unit.test_packing_architectures import largest_difference as packed_difference
from tests.unit.test_packing_architectures import packed_rows
from tests.unit.test_registry_families import NOT_BUILT, REFUSED

# Decoder layers that do not pass the forward's kwargs on to attention (transformers 5.23), so the offsets never
# reach it: the first packed forward is refused with the reason. A family that starts passing them fails the test,
# so this list only shrinks.
DROPS_OFFSETS = {"nemotron"}
VOCAB = 512
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def families() -> list[str]:
    skipped = NOT_BUILT | REFUSED  # no tiny model to build (test_registry_families.py says why)
    return [f for f in decoder_families() if f not in skipped]


def build(config: Any, kernel: str) -> Any:
    """The tiny model as a packed run trains it: layers with a state run once per sample (train/kernels.py)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=kernel, dtype=torch.float32).eval()
    if kinds := stateful_layer_kinds(config):
        apply_sample_boundaries(model, kinds)
    return model


def largest_difference(model: Any) -> float:
    """The largest |packed under varlen - alone under eager| logit difference, one model switched between them."""
    collator = DataCollator(0, attn_implementation=VARLEN, window_by_layer_type=layer_windows(model.config))
    batch = collator(packed_rows(VOCAB))
    assert "attention_mask" not in batch and "cu_seq_lens_q" in batch
    return packed_difference(model, collator, alone_kernel="eager", vocab_size=VOCAB)


@pytest.mark.parametrize("family", families())
def test_packed_samples_under_varlen_are_refused_or_equal_each_sample_alone(family: str) -> None:
    register_varlen()
    config = tiny_registry_config(family, VOCAB, SPECIAL_IDS)
    as_dict = config.to_dict()
    support = kernel_support(as_dict)
    refused = kernel_problem(VARLEN, support, family) or packing_problem(as_dict, support, VARLEN, family)
    if refused:
        assert refused.startswith(("attn_implementation (varlen)", "packing")), refused
        return
    model = build(config, VARLEN)
    if family in DROPS_OFFSETS:
        with pytest.raises(RuntimeError, match="without their sample offsets"):
            largest_difference(model)
        return
    assert largest_difference(model) < 1e-4


def states_a_window(family: str) -> bool:
    """The config states a sliding window, and every layer attends (layers with a state are the varlen test's)."""
    config = tiny_registry_config(family, VOCAB, SPECIAL_IDS)
    stated = any(getattr(sub, "sliding_window", None) for sub in (config, getattr(config, "text_config", None)))
    return stated and not stateful_layer_kinds(config)


@pytest.mark.parametrize("family", [f for f in families() if states_a_window(f)])
def test_packed_samples_under_a_dense_mask_keep_the_window_the_model_applies(family: str) -> None:
    """Packed rows under sdpa (eager where the class has no sdpa) take shardtune's block mask, with each layer
    kind's window: each sample's logits equal the sample alone. Moshi states a window its class never applies, so
    a mask with it made its packed samples see fewer tokens than padded ones (0.26 apart; model/attention.py's
    applies_sliding_window)."""
    config = tiny_registry_config(family, VOCAB, SPECIAL_IDS)
    as_dict = config.to_dict()
    support = kernel_support(as_dict)
    kernel = "sdpa" if support is None or support.sdpa else "eager"
    if packing_problem(as_dict, support, kernel, family):
        return  # refused before launch, with the reason (test_packing_architectures.py)
    model = build(config, kernel)
    collator = DataCollator(0, attn_implementation=kernel, window_by_layer_type=layer_windows(model.config))
    assert packed_difference(model, collator, vocab_size=VOCAB) < 1e-4
