"""Sequence parallelism through the real CLI: each sequence split over 2 or 4 CPU processes, under every engine,
gives the losses and gradient norms of one process on the whole rows (fp32).

The reference is one process with micro-batch 4 x accumulation 2; a split run with D data-parallel groups uses
micro-batch 4 / D, so every optimizer step sees the same samples. Gradient norms catch a gradient scaled by the
number of ranks (AdamW's update would hide it from the losses); the plain-SGD cells catch it in the losses too.
Packed rows (``packing: true``, cutoff 64) put several samples in a row, and samples cross the slice boundary.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.helpers import ENGINE_KEYS, logged, losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PACKED = ("packing=true", "cutoff_len=64")
PADDED = ("cutoff_len=64",)
SGD = ("optim=sgd", "learning_rate=0.5")
ROWS = {"packed": PACKED, "padded": PADDED, "packed-sgd": PACKED + SGD,
        # activation checkpointing recomputes each layer's attention in the backward, outside the forward's scope
        "packed-checkpointed": PACKED + ("gradient_checkpointing=true",),
        # the micro-batch's samples in one row, told apart by their segment ids only
        "padding-free": ("padding_free=true", "cutoff_len=64"),
        # a stream is dealt by data-parallel group: both ranks of the group must read the same rows
        "streaming": PADDED + ("streaming=true",),
        # evaluation's forward is split too; its loss sums every rank's slice tokens once
        "packed-eval": PACKED + ("val_size=8", "eval_strategy=steps", "eval_steps=2", "per_device_eval_batch_size=2"),
        # features that change weights or the optimizer only (engines/sequence_parallel_plan.py COMBINATIONS)
        "packed-lora-variants": PACKED + ("use_dora=true", "use_rslora=true", "loraplus_lr_ratio=16"),
        "packed-pissa": PACKED + ("pissa_init=true",),
        "packed-galore": PACKED + ("use_galore=true", "galore_update_interval=2"),
        "packed-apollo": PACKED + ("use_apollo=true", "apollo_update_interval=2"),
        "packed-adam-mini": PACKED + ("use_adam_mini=true",),
        "packed-resized": PACKED + ("resize_vocab=true", "add_special_tokens=<think>,</think>"),
        # bf16 autocast: the split sums attention in another order, equal within bf16's precision only
        "packed-bf16": PACKED + ("bf16=true",),
        # token-weighted losses read each slice's next tokens (shift_labels), as the plain loss does
        "packed-dft": PACKED + ("use_dft_loss=true",),
        "packed-eaft": PACKED + ("use_eaft_loss=true",),
        "packed-asft": PACKED + ("use_asft_loss=true",),
        "packed-smoothed": PACKED + ("label_smoothing_factor=0.1",),
        "packed-muon": PACKED + ("use_muon=true",),
        # stage pt packs one text into rows (no sample boundaries: a row is one segment)
        "pt-packed": ("stage=pt", "dataset=demo_pt", "cutoff_len=64")}
TOLERANCE = {"packed-bf16": 1e-3}  # relative (8e-5 measured); fp32 rows: 1e-4 for losses, 1e-3 for gradient norms

# (engine, finetuning, rows, processes, sequence_parallel_size, mode)
SLICE = [
    ("ddp", "full", "packed-checkpointed", 2, 2, "ulysses"),
    ("zero3", "lora", "packed-sgd", 2, 2, "allgather"),
    ("fsdp2", "full", "padded", 4, 2, "auto"),
]
MATRIX = [
    ("ddp", "full", "packed", 2, 2, "ulysses"),
    ("ddp", "lora", "padded", 2, 2, "allgather"),
    ("ddp", "full", "packed-sgd", 2, 2, "ulysses"),
    ("ddp", "full", "packed", 4, 4, "auto"),  # 2 KV heads: auto takes allgather at 4
    ("zero1", "full", "packed", 2, 2, "ulysses"),
    ("zero2", "full", "packed-sgd", 2, 2, "ulysses"),
    ("zero2", "lora", "packed", 4, 2, "allgather"),
    ("zero3", "full", "packed", 2, 2, "ulysses"),
    ("zero3", "full", "padded", 4, 4, "allgather"),
    ("fsdp2", "lora", "packed", 2, 2, "ulysses"),
    ("fsdp2", "full", "packed-sgd", 2, 2, "allgather"),
    ("hsdp", "full", "packed", 4, 2, "ulysses"),
    ("fsdp1", "full", "packed", 2, 2, "ulysses"),
    ("fsdp2", "full", "packed-checkpointed", 2, 2, "allgather"),
    ("ddp", "full", "padding-free", 2, 2, "allgather"),
    ("ddp", "lora", "streaming", 2, 2, "ulysses"),
    ("ddp", "full", "packed-eval", 2, 2, "allgather"),
    ("ddp", "lora", "packed-lora-variants", 2, 2, "ulysses"),
    ("ddp", "lora", "packed-pissa", 2, 2, "allgather"),
    ("ddp", "freeze", "packed", 2, 2, "ulysses"),
    ("ddp", "full", "packed-galore", 2, 2, "ulysses"),
    ("ddp", "full", "packed-apollo", 2, 2, "allgather"),
    ("ddp", "full", "packed-adam-mini", 2, 2, "ulysses"),
    ("ddp", "full", "packed-resized", 2, 2, "allgather"),
    ("ddp", "lora", "packed-bf16", 2, 2, "ulysses"),
    ("ddp", "full", "packed-dft", 2, 2, "ulysses"),
    ("ddp", "full", "packed-eaft", 2, 2, "allgather"),
    ("ddp", "lora", "packed-asft", 2, 2, "ulysses"),
    ("ddp", "full", "packed-smoothed", 2, 2, "allgather"),
    ("ddp", "full", "packed-muon", 2, 2, "ulysses"),
    ("ddp", "full", "pt-packed", 2, 2, "allgather"),
]
EXTRA_ENGINES = {"zero1": ("deepspeed=z1",),
                 "hsdp": ("fsdp=hybrid_shard auto_wrap", "fsdp_config={'hsdp_shard_size': 2}")}


def _cell_id(cell: tuple) -> str:
    engine, finetuning, rows, nproc, size, mode = cell
    return f"{engine}-{finetuning}-{rows}-{nproc}procs-sp{size}-{mode}"


CELLS = [pytest.param(*cell, id=_cell_id(cell)) for cell in SLICE]
CELLS += [pytest.param(*cell, id=_cell_id(cell), marks=pytest.mark.matrix) for cell in MATRIX]


def eval_losses(out) -> list[float]:
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["eval_loss"] for r in records if "eval_loss" in r]


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """Losses, gradient norms and eval losses of one process on whole rows, per (finetuning, rows)."""
    found: dict[tuple[str, str], tuple[list[float], list[float], list[float]]] = {}

    def reference(finetuning: str, rows: str) -> tuple[list[float], list[float], list[float]]:
        if (finetuning, rows) not in found:
            out = tmp_path_factory.mktemp(f"one-{finetuning}-{rows}")
            train(tiny_model_dir, out, finetuning, 1, 4, *ROWS[rows])
            found[finetuning, rows] = losses(out), logged(out, "grad_norm"), eval_losses(out)
        return found[finetuning, rows]

    return reference


@pytest.mark.parametrize("engine,finetuning,rows,nproc,size,mode", CELLS)
def test_split_sequences_match_one_process(engine, finetuning, rows, nproc, size, mode, one_process,
                                           tiny_model_dir, tmp_path):
    expected_losses, expected_norms, expected_eval = one_process(finetuning, rows)
    data_parallel = nproc // size
    keys = {**ENGINE_KEYS, **EXTRA_ENGINES}[engine]
    result = train(tiny_model_dir, tmp_path, finetuning, nproc, 4 // data_parallel, *keys, *ROWS[rows],
                   f"sequence_parallel_size={size}", f"sequence_parallel_mode={mode}")
    resolved = {"auto": "ulysses" if 2 % size == 0 else "allgather"}.get(mode, mode)  # 4 heads, 2 KV heads
    assert result["sequence_parallel"] == {"size": size, "mode": resolved, "data_parallel_size": data_parallel}
    assert losses(tmp_path) == pytest.approx(expected_losses, rel=TOLERANCE.get(rows, 1e-4))
    assert logged(tmp_path, "grad_norm") == pytest.approx(expected_norms, rel=TOLERANCE.get(rows, 1e-3))
    assert eval_losses(tmp_path) == pytest.approx(expected_eval, rel=1e-4)
    assert bool(expected_eval) == (rows == "packed-eval")


RESUMED = [pytest.param("ddp", 2, 1, id="ddp-sp2-then-sp1"),
           pytest.param("zero3", 1, 2, id="zero3-sp1-then-sp2"),
           pytest.param("fsdp2", 2, 1, id="fsdp2-sp2-then-sp1", marks=pytest.mark.matrix),
           pytest.param("zero2", 2, 1, id="zero2-sp2-then-sp1", marks=pytest.mark.matrix),
           pytest.param("zero1", 1, 2, id="zero1-sp1-then-sp2", marks=pytest.mark.matrix),
           pytest.param("fsdp1", 2, 1, id="fsdp1-sp2-then-sp1", marks=pytest.mark.matrix)]


@pytest.mark.parametrize("engine,written,resumed", RESUMED)
def test_resume_across_sequence_parallel_sizes(engine, written, resumed, tiny_model_dir, tmp_path):
    """A checkpoint written with one split resumes with another on the same 2 processes and the same global batch
    (4 rows per micro-step): the loss curve continues as the uninterrupted run's."""
    from tests.conftest import crash_after_checkpoint

    keys = {**ENGINE_KEYS, **EXTRA_ENGINES}[engine]
    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    settings = ("max_steps=6", "save_steps=3", "save_strategy=steps", *PACKED)

    def run(out, size, *extra):
        return train(tiny_model_dir, out, "full", 2, 4 // (2 // size), *keys, *settings,
                     f"sequence_parallel_size={size}", *extra)

    run(finished, written)
    crash_after_checkpoint(finished, crashed, 3)
    run(crashed, resumed, "overwrite_output_dir=false")
    expected, found = losses(finished), losses(crashed)
    assert len(found) == len(expected) == 6
    assert found[3:] == pytest.approx(expected[3:], rel=2e-3)
