"""A MoE model whose config has router_aux_loss_coef but whose code returns no aux_loss (Llama 4's text model in
transformers 5.23): trained without the term, said once, instead of stopping at the first step."""

from __future__ import annotations

import pytest
import torch

from shardtune.train import loss as loss_module
from shardtune.train.loss import causal_lm_loss_terms


def tiny_llama4_text():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    config = Llama4TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              num_local_experts=4, num_experts_per_tok=1)
    assert config.router_aux_loss_coef  # what the launching host reads: a coefficient
    return Llama4ForCausalLM(config)


@pytest.mark.parametrize("chunk_size", [0, 4])
def test_no_aux_loss_from_the_model_trains_without_the_term(chunk_size, capsys, monkeypatch):
    monkeypatch.setattr(loss_module, "_NO_AUX_LOSS_SAID", [])
    model = tiny_llama4_text()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with_aux, aux = causal_lm_loss_terms(model, {"input_ids": ids}, ids.clone(), chunk_size, router_aux=True)
    plain, _ = causal_lm_loss_terms(model, {"input_ids": ids}, ids.clone(), chunk_size)
    assert aux is None and torch.isfinite(with_aux)
    torch.testing.assert_close(with_aux.detach(), plain.detach())
    causal_lm_loss_terms(model, {"input_ids": ids}, ids.clone(), chunk_size, router_aux=True)
    said = [line for line in capsys.readouterr().err.splitlines() if "returns no router aux_loss" in line]
    assert len(said) == 1  # once per process, not once per step
