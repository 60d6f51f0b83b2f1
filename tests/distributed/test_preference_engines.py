"""Preference stages on 2 processes against one process with the same global batch, through the real CLI.

Per-step losses, gradient norms and rewards of the reward model (full and LoRA under DDP, ZeRO-2, ZeRO-3, FSDP2,
FSDP1, freeze under ZeRO-3 and FSDP2; its saved folder or adapter holds the one-process weights), of DPO (LoRA:
reference = adapters off, through the engine's wrapper; full: a frozen model placed as the policy, a replica under
DDP/ZeRO-2 and sharded under ZeRO-3 and FSDP) and of KTO (its KL estimate over both ranks' KL rows) must match the
single-process run, as the SFT engine tests require. Precomputed reference log-probabilities are checked against
the live reference of one process, and against the live sharded reference of the same engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.distributed.helpers import ENGINE_KEYS, check_saved_model, logged, train_with

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

COMMON = ("examples/tiny/dpo_lora.yaml", "max_steps=4", "logging_steps=1", "save_strategy=no", "plot_loss=false",
          "gradient_accumulation_steps=2", "learning_rate=5e-3", "lr_scheduler_type=constant")
STAGES = {"dpo-lora": ("finetuning_type=lora",),
          "dpo-full": ("finetuning_type=full", "learning_rate=1e-3"),
          "dpo-full-precomputed": ("finetuning_type=full", "learning_rate=1e-3", "precompute_ref_log_probs=true"),
          "kto-lora": ("finetuning_type=lora", "stage=kto", "dataset=demo_kto"),
          "kto-full": ("finetuning_type=full", "learning_rate=1e-3", "stage=kto", "dataset=demo_kto"),
          # ref_model = the base model: the same reference as adapters off, loaded and sharded by the engine.
          "dpo-lora-ref-model": ("finetuning_type=lora", "ref_model={model}"),
          "rm-full": ("finetuning_type=full", "stage=rm", "learning_rate=1e-3"),
          "rm-lora": ("finetuning_type=lora", "stage=rm", "learning_rate=1e-3"),
          "rm-freeze": ("finetuning_type=freeze", "freeze_trainable_layers=1", "stage=rm", "learning_rate=1e-3")}
# Precomputed reference log-probabilities are compared with the one-process run of the live reference.
ONE_PROCESS_RUN = {"dpo-full-precomputed": "dpo-full", "dpo-lora-ref-model": "dpo-lora"}
RUNS = [("ddp", "dpo-lora"), ("ddp", "dpo-full"), ("ddp", "kto-lora"), ("zero2", "dpo-lora"), ("zero2", "dpo-full"),
        ("zero3", "dpo-lora"), ("fsdp2", "dpo-lora"), ("fsdp2", "kto-lora"), ("zero3", "dpo-full-precomputed"),
        ("fsdp2", "dpo-full-precomputed"), ("ddp", "rm-full"),
        # A live full-parameter reference sharded as the policy (Engine.load_frozen).
        ("zero3", "dpo-full"), ("fsdp2", "dpo-full"), ("fsdp1", "dpo-full"), ("fsdp2", "kto-full"),
        ("zero3", "dpo-lora-ref-model"),
        # The reward model: the score layer drawn on the host and filled into the skeleton (FSDP) or partitioned by
        # DeepSpeed (ZeRO-3), saved whole.
        ("zero2", "rm-full"), ("zero3", "rm-full"), ("fsdp2", "rm-full"), ("fsdp1", "rm-full"),
        # KTO under ZeRO: LoRA on ZeRO-2, full with the live partitioned reference on ZeRO-3.
        ("zero2", "kto-lora"), ("zero3", "kto-full"),
        # LoRA reward models (the score layer trained in full beside the adapter, peft's modules_to_save) and freeze.
        ("ddp", "rm-lora"), ("zero2", "rm-lora"), ("zero3", "rm-lora"), ("fsdp2", "rm-lora"), ("fsdp1", "rm-lora"),
        ("zero3", "rm-freeze"), ("fsdp2", "rm-freeze")]
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")


def train(model: Path, out: Path, nproc: int, micro: int, *extra: str) -> dict:
    extra = tuple(value.replace("{model}", str(model)) for value in extra)  # ref_model={model}
    return train_with(COMMON, model, out, nproc, micro, *extra)


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> Callable[[str], Path]:
    """``one_process(stage)``: the single-process run, 4 pairs per micro-batch (2 per rank x 2 ranks below),
    trained the first time a selected cell asks for it (`make test` selects a few stages of the matrix)."""
    @functools.cache
    def run(stage: str) -> Path:
        out = tmp_path_factory.mktemp(f"one-{stage}")
        train(tiny_model_dir, out, 1, 4, *STAGES[stage])
        return out

    return run


@pytest.fixture(scope="module")
def two_processes(tiny_model_dir, tmp_path_factory):
    """``two_processes(engine, stage)``: the output folder of that 2-process run, trained once per module (the
    live-vs-precomputed test reuses the parity runs)."""
    done: dict[tuple[str, str], tuple[Path, dict]] = {}

    def run(engine: str, stage: str) -> tuple[Path, dict]:
        if (engine, stage) not in done:
            out = tmp_path_factory.mktemp(f"two-{engine}-{stage}")
            done[engine, stage] = out, train(tiny_model_dir, out, 2, 2, *STAGES[stage], *ENGINE_KEYS[engine])
        return done[engine, stage]

    return run


def compared_keys(stage: str) -> tuple[str, ...]:
    keys = COMPARED + (("kl",) if stage.startswith("kto") else ("rewards/accuracies",))
    if stage.startswith("rm"):  # scores, not log-probabilities
        keys = tuple(k for k in keys if not k.startswith("logps/"))
    return keys


@pytest.mark.parametrize(("engine", "stage"), RUNS, ids=[f"{e}-{s}" for e, s in RUNS])
def test_preference_stage_matches_one_process(engine, stage, one_process, two_processes, tiny_model_dir):
    out, results = two_processes(engine, stage)
    assert results["world_size"] == 2
    reference = one_process(ONE_PROCESS_RUN.get(stage, stage))
    for key in compared_keys(stage):
        assert logged(out, key) == pytest.approx(logged(reference, key), rel=2e-3, abs=1e-5), key
    if stage.startswith("rm"):
        check_saved_reward_model(out, reference)
    else:
        check_saved_model(out, tiny_model_dir, stage.split("-")[1])


def check_saved_reward_model(out: Path, reference: Path) -> None:
    """The folder loads whole as a sequence-classification model (a LoRA run: its adapter, score layer included)
    and holds the one-process run's trained weights (the score layer drawn alike on every engine, then trained
    alike)."""
    from transformers import AutoModelForSequenceClassification

    if (out / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        saved, expected = (load_file(str(folder / "adapter_model.safetensors")) for folder in (out, reference))
        assert saved.keys() == expected.keys() and "base_model.model.score.weight" in saved
        for name, tensor in expected.items():
            assert saved[name] == pytest.approx(tensor, abs=1e-4), name
        return

    model, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved, expected = model.state_dict(), AutoModelForSequenceClassification.from_pretrained(reference).state_dict()
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert saved[name] == pytest.approx(tensor, abs=1e-4), name


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_live_sharded_reference_equals_precomputed(engine, two_processes):
    """On one sharded engine, the live sharded reference and the precomputed log-probabilities train alike."""
    live, _ = two_processes(engine, "dpo-full")
    precomputed, _ = two_processes(engine, "dpo-full-precomputed")
    for key in compared_keys("dpo-full"):
        assert logged(live, key) == pytest.approx(logged(precomputed, key), rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_reward_model_resumes_on_the_same_curve(engine, tiny_model_dir, tmp_path):
    """A reward model whose run died after checkpoint-2 resumes (score layer included) and logs the uninterrupted
    run's steps 3 and 4."""
    from tests.conftest import crash_after_checkpoint

    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    keys = (*STAGES["rm-full"], *ENGINE_KEYS[engine], "save_strategy=steps", "save_steps=2")
    train(tiny_model_dir, finished, 2, 2, *keys)
    crash_after_checkpoint(finished, crashed, 2)
    assert (crashed / "checkpoint-2" / "COMPLETE").is_file() and len(logged(crashed, "loss")) == 2
    train(tiny_model_dir, crashed, 2, 2, *keys, "overwrite_output_dir=false")
    for key in ("loss", "grad_norm", "rewards/margins"):
        expected, resumed = logged(finished, key), logged(crashed, key)
        assert len(resumed) == 4 and resumed[2:] == pytest.approx(expected[2:], rel=1e-4, abs=1e-6), key
