"""Loop correctness on a tiny model in-process: accumulation equivalence, clipping, bf16 autocast."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune.engines.base import PrecisionSettings
from shardtune.engines.local import LocalEngine
from shardtune.optim.build import OptimizerSettings, build_optimizer, build_scheduler
from shardtune.train.loop import accumulation_windows, train_step


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def samples(n: int = 8, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Rows of different lengths with different numbers of trainable tokens (prompt masked)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 6 + 3 * i
        ids = torch.randint(0, 128, (length,), generator=g)
        labels = ids.clone()
        labels[: 2 + i % 4] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    longest = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.zeros(len(rows), longest, dtype=torch.long),
             "labels": torch.full((len(rows), longest), -100), "attention_mask": torch.zeros(len(rows), longest,
                                                                                            dtype=torch.long)}
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = r["input_ids"]
        batch["labels"][i, :n] = r["labels"]
        batch["attention_mask"][i, :n] = 1
    return batch


def make_engine(model, precision: PrecisionSettings | None = None, optim="sgd", lr=0.5,
                device: str = "cpu") -> LocalEngine:
    engine = LocalEngine(precision or PrecisionSettings(), torch.device(device))
    engine.prepare(model, lambda p: build_optimizer(p, OptimizerSettings(optim=optim, learning_rate=lr)),
                   lambda o: build_scheduler(o, "constant", 10, 0))
    return engine


def one_step(micro: int, accumulation: int, max_grad_norm: float = 0.0):
    engine = make_engine(tiny_llama())
    rows = samples()
    batches = [collate(rows[i:i + micro]) for i in range(0, len(rows), micro)]
    (window,) = list(accumulation_windows(batches, accumulation))
    metrics = train_step(engine, window, max_grad_norm)
    return metrics, engine.model.state_dict()


def test_accumulation_equals_one_big_batch():
    big_metrics, big_state = one_step(micro=8, accumulation=1)
    for micro, acc in ((4, 2), (2, 4), (1, 8)):
        metrics, state = one_step(micro, acc)
        assert metrics["loss"] == pytest.approx(big_metrics["loss"], rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(big_metrics["grad_norm"], rel=1e-4)
        for name, tensor in big_state.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-6)


def test_clipping_bounds_the_update():
    unclipped, state_free = one_step(8, 1, max_grad_norm=0.0)
    clipped, state_clip = one_step(8, 1, max_grad_norm=0.01)
    assert clipped["grad_norm"] == pytest.approx(unclipped["grad_norm"], rel=1e-5)  # reported before clipping
    start = tiny_llama().state_dict()
    step_free = torch.sqrt(sum(((state_free[k] - start[k]) ** 2).sum() for k in start))
    step_clip = torch.sqrt(sum(((state_clip[k] - start[k]) ** 2).sum() for k in start))
    assert float(step_clip) == pytest.approx(0.5 * 0.01, rel=1e-3)  # lr x max_grad_norm for SGD
    assert step_clip < step_free


def test_bf16_autocast_trains_on_cpu():
    engine = make_engine(tiny_llama(), PrecisionSettings(bf16=True), optim="adamw_torch", lr=1e-2)
    batch = collate(samples(4))
    losses = [train_step(engine, [batch], 1.0)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0]
    assert next(engine.model.parameters()).dtype == torch.float32  # master weights stay fp32


def test_fp16_autocast_with_loss_scaling():
    engine = make_engine(tiny_llama(), PrecisionSettings(fp16=True), optim="adamw_torch", lr=1e-2)
    assert engine.scaler is not None
    batch = collate(samples(4))
    losses = [train_step(engine, [batch], 1.0)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0]


def test_weight_decay_skips_biases_and_norms():
    model = tiny_llama()
    opt = build_optimizer(list(model.parameters()), OptimizerSettings(weight_decay=0.1))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, param in model.named_parameters():
        assert (id(param) in decayed) == (param.ndim >= 2), name
    assert copy.copy(opt.defaults)["lr"] == 5e-5


def test_fused_adamw_only_where_every_parameter_is_on_cuda():
    from shardtune.optim.build import fused_adamw_fits

    assert not fused_adamw_fits([torch.nn.Parameter(torch.ones(2))])
    assert not fused_adamw_fits([torch.nn.Parameter(torch.ones(2, device="meta"))])
    assert not fused_adamw_fits([])
