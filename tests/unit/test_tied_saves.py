"""A tied matrix gathered by a sharding engine arrives as two copies: it is saved once, and a broken tie is an error."""

from __future__ import annotations

import pytest
import torch

from shardtune.errors import ModelError
from shardtune.model.saved import count_saved_parameters, expected_saved_parameters, share_tied_tensors


@pytest.fixture(scope="module")
def qwen3(arch_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(arch_model_dir("qwen3"))


def gathered(model) -> dict[str, torch.Tensor]:
    """What FSDP's full state dict gives: every name its own copy, the tied head included."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_gathered_copies_of_a_tied_matrix_are_saved_once(qwen3, tmp_path):
    state = share_tied_tensors(qwen3, gathered(qwen3))
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    expected = expected_saved_parameters(qwen3, state)
    qwen3.save_pretrained(tmp_path, state_dict=state)
    assert count_saved_parameters(tmp_path) == expected == sum(p.numel() for p in qwen3.parameters())


def test_a_tie_broken_in_training_is_an_error(qwen3):
    state = gathered(qwen3)
    state["lm_head.weight"] += 1
    with pytest.raises(ModelError, match="lm_head.weight is tied to model.embed_tokens.weight"):
        share_tied_tensors(qwen3, state)


def test_an_untied_model_is_left_alone(arch_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(arch_model_dir("qwen2"))
    state = gathered(model)
    shared = share_tied_tensors(model, dict(state))
    assert all(shared[name] is state[name] for name in state)
