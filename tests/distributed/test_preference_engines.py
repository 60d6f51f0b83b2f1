"""Preference stages on 2 processes against one process with the same global batch, through the real CLI.

Per-step losses, gradient norms and rewards of the reward model (DDP), of DPO (LoRA: reference = adapters off,
through the engine's wrapper; full: a frozen replica) and of KTO (its KL estimate over both ranks' KL rows) must
match the single-process run, as the SFT engine tests require. Full-parameter DPO is refused under ZeRO-3 and FSDP
(the reference copy is not sharded yet; tests/unit/test_preference_step.py) unless the reference log-probabilities
are precomputed, which these runs check against the live reference of one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import ENGINE_KEYS, check_saved_model, logged

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

COMMON = ("examples/tiny/dpo_lora.yaml", "max_steps=4", "logging_steps=1", "save_strategy=no", "plot_loss=false",
          "gradient_accumulation_steps=2", "learning_rate=5e-3", "lr_scheduler_type=constant")
STAGES = {"dpo-lora": ("finetuning_type=lora",),
          "dpo-full": ("finetuning_type=full", "learning_rate=1e-3"),
          "dpo-full-precomputed": ("finetuning_type=full", "learning_rate=1e-3", "precompute_ref_log_probs=true"),
          "kto-lora": ("finetuning_type=lora", "stage=kto", "dataset=demo_kto"),
          "rm-full": ("finetuning_type=full", "stage=rm", "learning_rate=1e-3")}
# Precomputed reference log-probabilities are compared with the one-process run of the live reference.
ONE_PROCESS_RUN = {"dpo-full-precomputed": "dpo-full"}
RUNS = [("ddp", "dpo-lora"), ("ddp", "dpo-full"), ("ddp", "kto-lora"), ("zero2", "dpo-lora"), ("zero2", "dpo-full"),
        ("zero3", "dpo-lora"), ("fsdp2", "dpo-lora"), ("fsdp2", "kto-lora"), ("zero3", "dpo-full-precomputed"),
        ("fsdp2", "dpo-full-precomputed"), ("ddp", "rm-full")]
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")


def train(model: Path, out: Path, nproc: int, micro: int, *extra: str) -> dict:
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(nproc)} if nproc > 1 else {}
    result = run_cli("train", *COMMON, f"model_name_or_path={model}", f"output_dir={out}",
                     f"per_device_train_batch_size={micro}", *extra, **env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((out / "train_results.json").read_text())


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The single-process runs, 4 pairs per micro-batch (2 per rank x 2 ranks below)."""
    found = {}
    for stage in sorted({ONE_PROCESS_RUN.get(stage, stage) for _, stage in RUNS}):
        out = tmp_path_factory.mktemp(f"one-{stage}")
        train(tiny_model_dir, out, 1, 4, *STAGES[stage])
        found[stage] = out
    return found


@pytest.mark.parametrize(("engine", "stage"), RUNS, ids=[f"{e}-{s}" for e, s in RUNS])
def test_preference_stage_matches_one_process(engine, stage, one_process, tiny_model_dir, tmp_path):
    results = train(tiny_model_dir, tmp_path, 2, 2, *STAGES[stage], *ENGINE_KEYS[engine])
    assert results["world_size"] == 2
    reference = one_process[ONE_PROCESS_RUN.get(stage, stage)]
    keys = COMPARED + (("kl",) if stage.startswith("kto") else ("rewards/accuracies",))
    if stage.startswith("rm"):  # scores, not log-probabilities
        keys = tuple(k for k in keys if not k.startswith("logps/"))
    for key in keys:
        assert logged(tmp_path, key) == pytest.approx(logged(reference, key), rel=2e-3, abs=1e-5), key
    if not stage.startswith("rm"):  # the reward model's folder is checked in tests/e2e/test_preference_cli.py
        check_saved_model(tmp_path, tiny_model_dir, stage.split("-")[1])
