"""Sequence parallelism for the preference stages through the real CLI: every row of a pair split over 2 CPU
processes (sequence_parallel_size 2 x data parallel 1) gives the losses, gradient norms and rewards of one process
on the whole rows (fp32), with the same global batch (4 pairs per micro-batch x accumulation 2).

What each cell covers: DPO with the LoRA policy's adapters-off reference (the policy's own split forward), with a
live frozen copy (its attention routed through the split too) and with log-probabilities precomputed on the split
rows; ORPO (no reference, length-averaged log-probabilities, so the response lengths are summed over the group
too); KTO (the KL rows' reference point); the reward model (the score read on the rank whose slice holds the
row's last token). Gradient norms catch a gradient counted once per rank of the group (the pair count or the
reduction's backward wrong by the group size), which AdamW's normalised update would hide from the losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import ENGINE_KEYS, logged

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

COMMON = ("examples/tiny/dpo_lora.yaml", "max_steps=4", "logging_steps=1", "save_strategy=no", "plot_loss=false",
          "gradient_accumulation_steps=2", "learning_rate=5e-3", "lr_scheduler_type=constant",
          "per_device_train_batch_size=4")
STAGES = {"dpo-lora": ("finetuning_type=lora",),
          "dpo-full": ("finetuning_type=full", "learning_rate=1e-3"),
          "dpo-full-precomputed": ("finetuning_type=full", "learning_rate=1e-3", "precompute_ref_log_probs=true"),
          "orpo-lora": ("finetuning_type=lora", "pref_loss=orpo"),
          "kto-lora": ("finetuning_type=lora", "stage=kto", "dataset=demo_kto"),
          "rm-full": ("finetuning_type=full", "stage=rm", "learning_rate=1e-3"),
          "rm-lora": ("finetuning_type=lora", "stage=rm", "learning_rate=1e-3")}
# The precomputed reference is compared with one process's live reference.
ONE_PROCESS_RUN = {"dpo-full-precomputed": "dpo-full"}

# (engine, stage, mode)
SLICE = [("ddp", "dpo-lora", "ulysses"), ("zero3", "rm-full", "allgather")]
MATRIX = [("ddp", "dpo-full", "allgather"), ("ddp", "dpo-full-precomputed", "ulysses"),
          ("ddp", "orpo-lora", "ulysses"), ("ddp", "kto-lora", "allgather"), ("ddp", "rm-lora", "ulysses"),
          ("zero3", "dpo-lora", "allgather"), ("zero3", "dpo-full", "ulysses"), ("fsdp2", "dpo-full", "allgather"),
          ("fsdp2", "kto-lora", "ulysses"), ("fsdp2", "rm-full", "ulysses")]
CELLS = [pytest.param(*cell, id="-".join(cell)) for cell in SLICE]
CELLS += [pytest.param(*cell, id="-".join(cell), marks=pytest.mark.matrix) for cell in MATRIX]


def train(model: Path, out: Path, nproc: int, *extra: str) -> dict:
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(nproc)} if nproc > 1 else {}
    result = run_cli("train", *COMMON, f"model_name_or_path={model}", f"output_dir={out}", *extra, **env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((out / "train_results.json").read_text())


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """``one_process(stage)``: the output folder of the one-process run on whole rows, trained once per module."""
    found: dict[str, Path] = {}

    def run(stage: str) -> Path:
        stage = ONE_PROCESS_RUN.get(stage, stage)
        if stage not in found:
            found[stage] = tmp_path_factory.mktemp(f"one-{stage}")
            train(tiny_model_dir, found[stage], 1, *STAGES[stage])
        return found[stage]

    return run


def compared_keys(stage: str) -> tuple[str, ...]:
    if stage.startswith("rm"):
        return ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins")
    if stage.startswith("kto"):
        return ("loss", "grad_norm", "rewards/chosen", "logps/chosen", "kl")
    return ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.mark.parametrize("engine,stage,mode", CELLS)
def test_split_pairs_match_one_process(engine, stage, mode, one_process, tiny_model_dir, tmp_path):
    expected = one_process(stage)
    result = train(tiny_model_dir, tmp_path, 2, *STAGES[stage], *ENGINE_KEYS[engine], "sequence_parallel_size=2",
                   f"sequence_parallel_mode={mode}")
    assert result["sequence_parallel"] == {"size": 2, "mode": mode, "data_parallel_size": 1}
    for key in compared_keys(stage):
        tolerance = 1e-3 if key == "grad_norm" else 1e-4
        found = logged(tmp_path, key)
        assert len(found) == 4 and found == pytest.approx(logged(expected, key), rel=tolerance, abs=1e-6), key
