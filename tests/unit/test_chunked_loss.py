"""The chunked loss (shardtune.train.loss) against the full-logits path: same loss, same gradient of every
parameter, for full and LoRA fine-tuning, tied and untied heads, masked, padded and packed batches."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune.data.collator import DataCollator
from shardtune.engines.base import PrecisionSettings
from shardtune.errors import ModelError
from shardtune.model.finetuning.apply import apply_finetuning
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.train import loss as loss_module
from shardtune.train.loop import evaluate, token_loss_sum, train_step
from shardtune.train.loss import DEFAULT_LOSS_CHUNK_SIZE, causal_lm_loss_sum, linear_cross_entropy_sum
from tests.unit.test_data_packing import varlen_reference_attention
from tests.unit.test_loop import make_engine

VOCAB = 101
M = -100


def tiny_llama(tied: bool = False, seed: int = 0, **config: Any) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    settings = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                "tie_word_embeddings": tied, "initializer_range": 0.1, **config}
    return LlamaForCausalLM(LlamaConfig(**settings))


def finetuned(model: torch.nn.Module, finetuning: str) -> torch.nn.Module:
    model = apply_finetuning(model, FinetuningSettings(finetuning_type=finetuning))
    if finetuning == "lora":  # lora_B starts at zero: make the adapters matter for the gradients
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
    return model


def features(seed: int = 1, packed: bool = False) -> list[dict[str, list[int]]]:
    """Rows of different lengths, each prompt masked; packed rows hold 2-3 samples (first labels masked)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(3):
        segments = [5 + 4 * i + s for s in range(2 + i % 2)] if packed else [9 + 7 * i]
        row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
        for number, length in enumerate(segments, start=1):
            ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
            prompt = 1 + (i + number) % 4
            row["input_ids"] += ids
            row["labels"] += [M] * prompt + ids[prompt:]
            row["position_ids"] += list(range(length))
            row["segment_ids"] += [number] * length
        if not packed:
            del row["position_ids"], row["segment_ids"]
        rows.append(row)
    return rows


def batch_of(rows: list[dict[str, list[int]]], attn: str = "sdpa") -> dict[str, Any]:
    return DataCollator(pad_token_id=0, attn_implementation=attn)(rows)


def loss_and_grads(model: torch.nn.Module, batch: dict[str, Any], chunk_size: int,
                   bf16: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _ = token_loss_sum(model, batch, chunk_size)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return loss.detach(), grads


def assert_same(model: torch.nn.Module, batch: dict[str, Any], chunk_size: int, bf16: bool = False) -> None:
    reference_loss, reference = loss_and_grads(model, batch, 0, bf16)
    loss, grads = loss_and_grads(model, batch, chunk_size, bf16)
    # bf16: the head's weight gradient is summed from per-chunk bf16 products instead of one (a few bf16 ulps)
    rel = 1e-2 if bf16 else 1e-5
    assert loss == pytest.approx(float(reference_loss), rel=1e-6)
    assert grads.keys() == reference.keys()
    for name, grad in grads.items():
        difference = float((grad - reference[name]).norm() / reference[name].norm().clamp(min=1e-30))
        assert difference < rel, f"{name}: relative difference {difference:.2e}"


@pytest.mark.parametrize("finetuning", ["full", "lora"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk_size", [1, 7, DEFAULT_LOSS_CHUNK_SIZE])
def test_padded_batch_matches_full_logits(finetuning, tied, chunk_size):
    assert_same(finetuned(tiny_llama(tied), finetuning), batch_of(features()), chunk_size)


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_packed_rows_with_a_4d_mask_match_full_logits(finetuning):
    batch = batch_of(features(packed=True))
    assert batch["attention_mask"].dim() == 4 and "position_ids" in batch
    assert_same(finetuned(tiny_llama(tied=True), finetuning), batch, 5)


def test_flash_varlen_kwargs_reach_the_model_and_match_full_logits():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register("varlen_reference", varlen_reference_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("varlen_reference", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    batch = batch_of(features(packed=True), attn="flash_attention_2")
    assert "cu_seq_lens_q" in batch and "attention_mask" not in batch
    model = tiny_llama(attn_implementation="varlen_reference")
    assert_same(model, batch, 6)
    # The offsets reach attention: offsets of whole rows (samples seeing each other) give another loss.
    rows, length = batch["input_ids"].shape
    whole_rows = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32)
    crossing = {**batch, "cu_seq_lens_q": whole_rows, "cu_seq_lens_k": whole_rows}
    with torch.no_grad():
        assert abs(float(token_loss_sum(model, crossing, 6)[0]) - float(token_loss_sum(model, batch, 6)[0])) > 1e-3


@pytest.mark.parametrize("finetuning", ["full", "lora"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_autocast_matches_full_logits(finetuning, tied, monkeypatch):
    monkeypatch.setattr(loss_module, "PRODUCT_BLOCK_ROWS", 16)  # the head's weight gradient in several row blocks
    assert_same(finetuned(tiny_llama(tied), finetuning), batch_of(features(packed=True)), 9, bf16=True)


def test_head_with_a_bias_matches_full_logits():
    model = tiny_llama()
    torch.manual_seed(3)
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    assert_same(model, batch_of(features()), 4)


def test_fully_masked_batch_gives_zero_loss_and_zero_gradients_everywhere():
    rows = [{"input_ids": [1, 2, 3, 4], "labels": [M] * 4}]
    loss, grads = loss_and_grads(tiny_llama(), batch_of(rows), 8)
    assert float(loss) == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in grads.values())


def test_chunks_skip_masked_positions_and_never_build_the_full_logits(monkeypatch):
    """The head's matmuls see at most chunk_size rows, only the trainable ones, and each once."""
    model, batch, rows_seen = tiny_llama(), batch_of(features()), []
    trainable = int((batch["labels"][:, 1:] != M).sum())
    linear = torch.nn.functional.linear

    def recording_linear(x, w, b=None):
        if w.shape[0] == VOCAB:
            rows_seen.append(x.shape[0])
        return linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    loss, _ = token_loss_sum(model, batch, 8)
    loss.backward()
    # Each trainable row's logits once, in the forward: the backward recomputes nothing.
    assert max(rows_seen) == 8 and sum(rows_seen) == trainable
    assert trainable < batch["input_ids"].numel()


def test_evaluation_and_train_step_follow_the_setting():
    batch = batch_of(features())
    results = []
    for chunk_size in (0, 3):
        engine = make_engine(tiny_llama())
        eval_loss = evaluate(engine, [batch], chunk_size)
        metrics = train_step(engine, [batch], 1.0, chunk_size)
        results.append((eval_loss, metrics["loss"], metrics["grad_norm"],
                        [p.detach().clone() for p in engine.model.parameters()]))
    (e0, l0, n0, p0), (e1, l1, n1, p1) = results
    assert (e1, l1, n1) == pytest.approx((e0, l0, n0), rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(p0, p1, strict=True))


def test_bf16_train_step_through_the_engine_autocast():
    batch = batch_of(features(packed=True))
    found = [train_step(make_engine(tiny_llama(), PrecisionSettings(bf16=True)), [batch], 1.0, chunk)
             for chunk in (0, 4)]
    assert found[1]["loss"] == pytest.approx(found[0]["loss"], rel=1e-5)
    assert found[1]["grad_norm"] == pytest.approx(found[0]["grad_norm"], rel=1e-2)


# --- heads the chunked path cannot compute exactly fall back to the full logits, and say why ---

def test_soft_capped_logits_fall_back_with_a_reason():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=8, final_logit_softcapping=5.0))
    with pytest.warns(UserWarning, match="final_logit_softcapping"):
        assert_same(model, batch_of(features()), 4)


def test_xlstm_soft_capped_logits_fall_back_with_a_reason():
    """xLSTM names its cap output_logit_soft_cap (the registry matrix found it: the chunked loss refused it)."""
    from transformers import AutoModelForCausalLM

    from shardtune.model.registry import tiny_registry_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_registry_config("xlstm", VOCAB))
    with pytest.warns(UserWarning, match="output_logit_soft_cap"):
        assert_same(model, batch_of(features()), 4)


def test_lora_on_the_head_falls_back_with_a_reason():
    from peft import LoraConfig, get_peft_model

    # shardtune's lora_target never adapts the head; a model adapted elsewhere may arrive like this.
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["lm_head", "q_proj"],
                                                    init_lora_weights=False))
    with pytest.warns(UserWarning, match="not a plain Linear"):
        assert_same(model, batch_of(features()), 4)


class ScaledLlama(LlamaForCausalLM):
    """A model that rescales its logits after the head without a config key announcing it."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 0.5
        return output


def test_unannounced_logit_postprocessing_is_caught():
    torch.manual_seed(0)
    model = ScaledLlama(tiny_llama().config)
    with pytest.raises(ModelError, match="loss_chunk_size: 0"):
        token_loss_sum(model, batch_of(features()), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        token_loss_sum(model, batch_of(features()), 0)  # the full-logits path is untouched


def test_a_head_that_sees_only_some_positions_is_refused():
    batch = batch_of(features())
    inputs = {"input_ids": batch["input_ids"], "logits_to_keep": 1}  # the head gets the last position only
    with pytest.raises(ModelError, match="do not match the labels"):
        causal_lm_loss_sum(tiny_llama(), inputs, batch["labels"], 4)


def test_a_head_called_on_several_rows_per_label_falls_back_to_the_full_logits():
    """ProphetNet calls its head once on (rows, n-gram streams, tokens, hidden) and returns the first stream as its
    logits: the loss is that of the full logits (it failed every cell of the registry matrix before)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("prophetnet", vocab_size=VOCAB, hidden_size=16, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, num_encoder_layers=1, num_decoder_layers=1,
                                  num_encoder_attention_heads=2, num_decoder_attention_heads=2, ngram=2)
    model = AutoModelForCausalLM.from_config(config).eval()  # no dropout: the two calls compare exactly
    batch = batch_of(features())
    inputs = {"input_ids": batch["input_ids"]}
    chunked = causal_lm_loss_sum(model, inputs, batch["labels"], 4)
    full = causal_lm_loss_sum(model, inputs, batch["labels"], 0)
    assert torch.equal(chunked, full)


def random_head_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 hidden states [2, 9, 16], a head's weight and bias (VOCAB rows) and targets with three masked."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(VOCAB, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(VOCAB, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, VOCAB, (2, 9))
    targets[0, :3] = M
    return hidden, weight, bias, targets


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_function_matches_cross_entropy_directly(smoothing):
    """Loss and the gradients of hidden states, weight and bias against autograd through F.cross_entropy (fp64),
    with an incoming gradient other than 1 (the loop scales the loss before its backward)."""
    hidden, weight, bias, targets = random_head_inputs()
    expected = torch.nn.functional.cross_entropy((hidden @ weight.t() + bias).reshape(-1, VOCAB),
                                                 targets.reshape(-1), ignore_index=M, reduction="sum",
                                                 label_smoothing=smoothing)
    reference = torch.autograd.grad(expected * 0.37, (hidden, weight, bias))
    found = linear_cross_entropy_sum(hidden, weight, bias, targets, 4, smoothing)
    assert float(found) == pytest.approx(float(expected), rel=1e-12)
    for got, want in zip(torch.autograd.grad(found * 0.37, (hidden, weight, bias)), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_second_backward_through_the_same_loss_is_refused():
    hidden = torch.randn(1, 5, 8, requires_grad=True)
    loss = linear_cross_entropy_sum(hidden, torch.randn(VOCAB, 8), None, torch.randint(0, VOCAB, (1, 5)), 2)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="back-propagated twice"):
        loss.backward()


def test_evaluation_under_no_grad_forms_no_gradients(monkeypatch):
    """Under no_grad only the loss is computed: one head matmul per chunk and no gradient matmuls."""
    calls = []
    matmul = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: calls.append(1) or matmul(a, b))
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(torch.randn(1, 6, 8), weight, None, torch.randint(0, VOCAB, (1, 6)), 2)
    assert not loss.requires_grad and calls == []


def test_the_config_key_reaches_the_loop():
    from shardtune.config.schema import TrainConfig
    from shardtune.train.workflow import loop_settings

    assert loop_settings(TrainConfig(loss_chunk_size=37), 10, False).loss_chunk_size == 37
    assert loop_settings(TrainConfig(), 10, False).loss_chunk_size == DEFAULT_LOSS_CHUNK_SIZE > 0


def test_a_bf16_head_sums_its_weight_gradient_in_fp32():
    """FSDP's mixed precision and DeepSpeed's bf16 hand the head a bf16 weight: the weight gradient summed over many
    chunks must stay as close to the exact one as the plain path's single bf16 matmul, not lose each chunk's
    small share against a large bf16 running sum."""
    torch.manual_seed(0)
    rows, width = 2048, 16
    hidden = torch.randn(1, rows, width, dtype=torch.float64)
    weight = torch.randn(VOCAB, width, dtype=torch.float64) * 0.1
    targets = torch.randint(0, VOCAB, (1, rows))

    def weight_grad(dtype: torch.dtype, chunk_size: int | None) -> torch.Tensor:
        w = weight.detach().to(dtype).clone().requires_grad_(True)
        h = hidden.to(dtype)
        if chunk_size is None:  # the plain path: one matmul for the whole gradient
            plain = torch.nn.functional.cross_entropy((h @ w.t()).float().reshape(-1, VOCAB), targets.reshape(-1),
                                                      reduction="sum")
            plain.backward()
        else:
            linear_cross_entropy_sum(h, w, None, targets, chunk_size).backward()
        assert w.grad is not None and w.grad.dtype == dtype
        return w.grad.double()

    exact = weight_grad(torch.float64, None)
    plain_error = (weight_grad(torch.bfloat16, None) - exact).abs().max()
    chunked_error = (weight_grad(torch.bfloat16, 8) - exact).abs().max()  # 256 chunks
    assert chunked_error <= 2 * plain_error, (float(chunked_error), float(plain_error))
