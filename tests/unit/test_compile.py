"""torch_compile: regional compilation of each decoder layer gives the eager run's losses and gradient norms, full
and LoRA, compiles nothing after step 2, and is refused before launch where an engine cannot take it."""

from __future__ import annotations

import copy

import pytest
import torch

from shardtune.config.schema import TrainConfig
from shardtune.engines.plan import plan_engine
from shardtune.model.compile import CompileReport, apply_regional_compile, decoder_layers
from shardtune.train.loop import train_step
from tests.unit.test_chunked_loss import batch_of, features, finetuned, tiny_llama
from tests.unit.test_loop import make_engine


def losses_and_norms(model: torch.nn.Module, compiled: bool, steps: int = 4) -> tuple[list[float], list[float],
                                                                                      CompileReport | None]:
    # Windows of different lengths: the compiled layers meet new shapes after the first step.
    windows = [[batch_of(features(seed=step)), batch_of(features(seed=10 + step))] for step in range(1, steps + 1)]
    return train_windows(model, compiled, windows)


def train_windows(model: torch.nn.Module, compiled: bool, windows: list[list[dict]]) -> tuple[list[float], list[float],
                                                                                              CompileReport | None]:
    """One optimizer step per window on a copy of ``model`` (its decoder layers compiled or not): the losses, the
    gradient norms and, compiled, the compile report."""
    model = copy.deepcopy(model)
    report = None
    if compiled:
        torch._dynamo.reset()
        report = CompileReport(apply_regional_compile(model, None, "aot_eager"), None, "aot_eager")
    engine = make_engine(model, optim="adamw_torch", lr=1e-2)
    losses, norms = [], []
    for step, window in enumerate(windows, start=1):
        metrics = train_step(engine, window, max_grad_norm=1.0)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
        if report is not None:
            report.on_step(step)
    return losses, norms, report


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_compiled_layers_train_as_the_eager_model(finetuning):
    model = finetuned(tiny_llama(), finetuning)
    eager_losses, eager_norms, _ = losses_and_norms(model, compiled=False)
    losses, norms, report = losses_and_norms(model, compiled=True)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert norms == pytest.approx(eager_norms, rel=1e-4)
    assert report is not None
    summary = report.summary()
    assert summary["layers"] == 2 and summary["graphs"] >= 1
    assert summary["recompiles_after_step_2"] == 0
    assert "2 decoder layers compiled" in report.line()


def test_layers_compile_in_place_and_keep_their_names():
    model = finetuned(tiny_llama(), "lora")
    names = [n for n, _ in model.named_parameters()]
    apply_regional_compile(model, None, "aot_eager")
    assert [n for n, _ in model.named_parameters()] == names
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model))


@pytest.mark.parametrize(("engine_keys", "reason"), [
    ({"deepspeed": "z3"}, "ZeRO-3 gathers"),
    ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 1}}, "FSDP1 flattens"),
    ({"quantization_bit": 4, "bf16": True}, "not traceable"),
    ({"gradient_checkpointing": True}, "activation checkpointing"),
])
def test_refused_before_launch_with_the_reason(engine_keys, reason):
    c = TrainConfig(model_name_or_path="m", torch_compile=True, **engine_keys)
    _, problems = plan_engine(c, world_size=2, has_cuda=False)
    assert any("torch_compile (true)" in p and reason in p for p in problems), problems


@pytest.mark.parametrize("engine_keys", [{}, {"deepspeed": "z2"}, {"fsdp": "full_shard auto_wrap"}])
def test_taken_by_local_ddp_zero2_and_fsdp2(engine_keys):
    c = TrainConfig(model_name_or_path="m", torch_compile=True, **engine_keys)
    _, problems = plan_engine(c, world_size=2, has_cuda=False)
    assert not [p for p in problems if "torch_compile" in p]


def padded_rows(lengths: list[int], seed: int) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        ids = torch.randint(0, 100, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    return rows


# Steps 1-2 unpadded, then a padded row (a mask where there was none), a shorter micro-batch (the epoch's last),
# both, and longer rows: each change compiled another graph before (3 after step 2 on this plan).
CHANGING_BATCHES = [[16, 16, 16], [20, 20, 20], [16, 12, 16], [16, 16], [16, 9], [30, 30, 30]]


def changing_batches_run(model: torch.nn.Module, compiled: bool) -> tuple[list[float], list[float],
                                                                          CompileReport | None]:
    from shardtune.data.collator import DataCollator

    # The compiled run's rows come as torch_compile makes them (train/setup.py): padding without a mask.
    collate = DataCollator(pad_token_id=0, attn_implementation="sdpa", unmasked_padding=compiled)
    windows = [[collate(padded_rows(lengths, step))] for step, lengths in enumerate(CHANGING_BATCHES, start=1)]
    return train_windows(model, compiled, windows)


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_padded_rows_and_a_shorter_last_batch_compile_nothing_after_step_2(finetuning):
    model = finetuned(tiny_llama(), finetuning)
    eager_losses, eager_norms, _ = changing_batches_run(model, compiled=False)
    losses, norms, report = changing_batches_run(model, compiled=True)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert norms == pytest.approx(eager_norms, rel=1e-4)
    assert report is not None and report.summary()["recompiles_after_step_2"] == 0, report.summary()


def test_unmasked_padding_continues_positions_and_leaves_packed_rows_alone():
    from shardtune.data.collator import DataCollator

    collate = DataCollator(pad_token_id=0, attn_implementation="sdpa", unmasked_padding=True)
    batch = collate(padded_rows([5, 3], seed=0))
    assert "attention_mask" not in batch and int(batch["num_tokens"]) == 8
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert batch["labels"][1, 3:].tolist() == [-100, -100]
    packed = collate(features(seed=1, packed=True))
    assert packed["attention_mask"].dim() == 4  # packed rows keep their block mask


def test_padding_goes_unmasked_only_where_it_computes_the_same_loss(tmp_path):
    from shardtune.model.tiny import build_tiny_model
    from shardtune.train.setup import padding_left_unmasked

    folders = {arch: str(build_tiny_model(tmp_path / arch, arch=arch)) for arch in ("llama", "mistral", "mixtral")}

    def unmasked(arch: str, **keys) -> bool:
        keys = {"torch_compile": True, "stage": "sft", **keys}
        return padding_left_unmasked(TrainConfig(model_name_or_path=folders[arch], **keys))

    assert unmasked("llama") and unmasked("llama", stage="pt", packing=False)  # pt packs by default
    assert not unmasked("llama", torch_compile=False)
    assert not unmasked("llama", stage="dpo")  # pairs are scored by row: left as they are
    assert not unmasked("llama", packing=True)
    assert not unmasked("mistral")  # its sliding window brings a mask of its own on long rows
    assert not unmasked("mixtral")  # the router loss leaves padding out by the mask
