"""Sequence parallelism for the preference stages through the real CLI: every row of a pair split over 2 CPU
processes (sequence_parallel_size 2 x data parallel 1; one matrix cell 4 processes, 2 x 2) gives the losses,
gradient norms and rewards of one process on the whole rows (fp32), with the same global batch (4 pairs per
micro-batch x accumulation 2).

What each cell covers: DPO with the LoRA policy's adapters-off reference (the policy's own split forward), with a
live frozen copy (its attention routed through the split too) and with log-probabilities precomputed on the split
rows; ORPO (no reference, length-averaged log-probabilities, so the response lengths are summed over the group
too); KTO (the KL rows' reference point); the reward model (the score read on the rank whose slice holds the
row's last token). The stages with EVAL evaluate at steps 2 and 4 too. Gradient norms catch a gradient counted
once per rank of the group (the pair count or the reduction's backward wrong by the group size), which AdamW's
normalised update would hide from the losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.helpers import ENGINE_KEYS, logged, train_with

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

COMMON = ("examples/tiny/dpo_lora.yaml", "max_steps=4", "logging_steps=1", "save_strategy=no", "plot_loss=false",
          "gradient_accumulation_steps=2", "learning_rate=5e-3", "lr_scheduler_type=constant")
EVAL = ("val_size=0.2", "eval_strategy=steps", "eval_steps=2", "per_device_eval_batch_size=4")
STAGES = {"dpo-lora": ("finetuning_type=lora",),
          "dpo-full": ("finetuning_type=full", "learning_rate=1e-3", *EVAL),
          "dpo-full-precomputed": ("finetuning_type=full", "learning_rate=1e-3", "precompute_ref_log_probs=true",
                                   *EVAL),
          "orpo-lora": ("finetuning_type=lora", "pref_loss=orpo"),
          "kto-lora": ("finetuning_type=lora", "stage=kto", "dataset=demo_kto", *EVAL),
          "rm-full": ("finetuning_type=full", "stage=rm", "learning_rate=1e-3"),
          "rm-lora": ("finetuning_type=lora", "stage=rm", "learning_rate=1e-3", *EVAL)}
# The precomputed reference is compared with one process's live reference.
ONE_PROCESS_RUN = {"dpo-full-precomputed": "dpo-full"}

# (engine, stage, mode, processes)
SLICE = [("ddp", "dpo-lora", "ulysses", 2), ("zero3", "rm-full", "allgather", 2)]
MATRIX = [("ddp", "dpo-full", "allgather", 2), ("ddp", "dpo-full-precomputed", "ulysses", 2),
          ("ddp", "orpo-lora", "ulysses", 2), ("ddp", "kto-lora", "allgather", 2), ("ddp", "rm-lora", "ulysses", 2),
          ("zero3", "dpo-lora", "allgather", 2), ("zero3", "dpo-full", "ulysses", 2),
          ("fsdp2", "dpo-full", "allgather", 2), ("fsdp2", "kto-lora", "ulysses", 2),
          ("fsdp2", "rm-full", "ulysses", 2),
          # Two data-parallel groups: the precomputing pass deals samples over groups, not ranks.
          ("ddp", "dpo-full-precomputed", "allgather", 4)]


def _cell_id(cell: tuple) -> str:
    engine, stage, mode, nproc = cell
    return f"{engine}-{stage}-{mode}" + (f"-{nproc}procs" if nproc != 2 else "")


CELLS = [pytest.param(*cell, id=_cell_id(cell)) for cell in SLICE]
CELLS += [pytest.param(*cell, id=_cell_id(cell), marks=pytest.mark.matrix) for cell in MATRIX]


def train(model: Path, out: Path, nproc: int, micro: int, *extra: str) -> dict:
    return train_with(COMMON, model, out, nproc, micro, *extra)


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """``one_process(stage)``: the output folder of the one-process run on whole rows, trained once per module."""
    found: dict[str, Path] = {}

    def run(stage: str) -> Path:
        stage = ONE_PROCESS_RUN.get(stage, stage)
        if stage not in found:
            found[stage] = tmp_path_factory.mktemp(f"one-{stage}")
            train(tiny_model_dir, found[stage], 1, 4, *STAGES[stage])
        return found[stage]

    return run


def evaluated(out: Path) -> list[dict]:
    """The eval records of trainer_log.jsonl."""
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in records if "eval_loss" in r]


def compared_keys(stage: str) -> tuple[str, ...]:
    if stage.startswith("rm"):
        return ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins")
    if stage.startswith("kto"):
        return ("loss", "grad_norm", "rewards/chosen", "logps/chosen", "kl")
    return ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.mark.parametrize("engine,stage,mode,nproc", CELLS)
def test_split_pairs_match_one_process(engine, stage, mode, nproc, one_process, tiny_model_dir, tmp_path):
    expected = one_process(stage)
    data_parallel = nproc // 2
    result = train(tiny_model_dir, tmp_path, nproc, 4 // data_parallel, *STAGES[stage], *ENGINE_KEYS[engine],
                   "sequence_parallel_size=2", f"sequence_parallel_mode={mode}")
    assert result["sequence_parallel"] == {"size": 2, "mode": mode, "data_parallel_size": data_parallel}
    for key in compared_keys(stage):
        tolerance = 1e-3 if key == "grad_norm" else 1e-4
        found = logged(tmp_path, key)
        assert len(found) == 4 and found == pytest.approx(logged(expected, key), rel=tolerance, abs=1e-6), key
    if EVAL[0] in STAGES[stage]:
        split, whole = evaluated(tmp_path), evaluated(expected)
        assert len(split) == len(whole) == 2
        for key in ("loss", *(k for k in compared_keys(stage) if k != "grad_norm")):
            assert [r[f"eval_{key}"] for r in split] == pytest.approx([r[f"eval_{key}"] for r in whole], rel=1e-4,
                                                                      abs=1e-6), f"eval_{key}"
