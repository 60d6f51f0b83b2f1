"""Under autocast, peft's cast of a LoRA layer's input to the fp32 adapter weights (undone at once by autocast) is
switched off: the same loss and gradients bit for bit, fewer copies (model/finetuning/lora.py)."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

from shardtune.model.finetuning.lora import leave_adapter_inputs_to_autocast, store_frozen_bases_in
from tests.unit.test_chunked_loss import tiny_llama


def step(model, ids):
    model.zero_grad()
    with torch.profiler.profile() as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids).logits.float().square().mean()
        loss.backward()
    copies = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, copies


def test_the_same_loss_and_gradients_with_fewer_copies():
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    ids = torch.randint(0, 100, (2, 64))
    twin = copy.deepcopy(model)
    assert leave_adapter_inputs_to_autocast(twin) == 14  # 7 linear layers x 2 decoder layers
    torch.manual_seed(1)
    loss, grads, copies = step(model, ids)
    torch.manual_seed(1)
    twin_loss, twin_grads, twin_copies = step(twin, ids)
    assert twin_loss == loss
    assert grads.keys() == twin_grads.keys() and all(torch.equal(grads[k], twin_grads[k]) for k in grads)
    # o_proj and down_proj take bf16 inputs (attention output, the MLP's product): per layer and module two copies in
    # the forward (to fp32 and back) and two in the backward
    assert copies - twin_copies == 2 * 2 * 4


def test_layers_with_dropout_keep_the_cast():
    """Dropout draws a different mask on bf16 than on fp32 input: those layers are left as peft has them."""
    model = get_peft_model(tiny_llama(), LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.1))
    assert leave_adapter_inputs_to_autocast(model) == 0


def test_frozen_bases_in_bf16_train_the_same_with_fewer_casts():
    """Autocast casts a frozen fp32 base weight again at every call; stored in bf16 it is the same matmul."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    leave_adapter_inputs_to_autocast(model)
    ids = torch.randint(0, 100, (2, 64))
    twin = copy.deepcopy(model)
    assert store_frozen_bases_in(twin, torch.bfloat16) == 14
    bases = {n: p.dtype for n, p in twin.named_parameters() if "base_layer" in n}
    assert bases and set(bases.values()) == {torch.bfloat16}
    # Everything else keeps fp32: the adapters (trained), embeddings, norms and the output layer.
    assert all(p.dtype == torch.float32 for n, p in twin.named_parameters() if "base_layer" not in n)
    loss, grads, copies = step(model, ids)
    twin_loss, twin_grads, twin_copies = step(twin, ids)
    assert twin_loss == loss
    assert grads.keys() == twin_grads.keys() and all(torch.equal(grads[k], twin_grads[k]) for k in grads)
    assert copies - twin_copies == 2 * 7  # one cast per base weight and forward: 7 per decoder layer


def test_dora_and_other_variants_keep_their_fp32_base():
    model = get_peft_model(tiny_llama(), LoraConfig(r=8, target_modules="all-linear", use_dora=True))
    assert store_frozen_bases_in(model, torch.bfloat16) == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
