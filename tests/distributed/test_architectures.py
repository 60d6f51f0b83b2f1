"""Dense and tied-embedding families under every engine, 2 gloo processes on CPU against one process.

Per family x engine x (full, LoRA), one run of 6 steps with a checkpoint at step 3 proves three things: its per-step
losses equal a 1-process run with the same global batch; the saved output reloads in plain transformers/peft with
the logits of the 1-process trained model (a tied model still tied: one matrix in the files, ``lm_head`` the
embedding after reload, also after ``shardtune export`` of the last checkpoint); and a copy of the run cut after
checkpoint-3 resumes onto the same curve and saves the same model.

`make test` runs the slice in ``SLICE`` (each engine and each tied family at least once); the rest is marked
``matrix`` (`make test-matrix`). scripts/architecture_table.py renders this parametrization in the README.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.distributed.helpers import ENGINE_KEYS, losses, train
from tests.distributed.test_checkpoints import assert_resumed_like_finished, crash_after_first_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

FAMILIES = ("qwen3", "gemma3", "gemma2", "mistral", "phi3", "glm4", "qwen2")  # llama: test_engines_cli.py
ENGINES = ENGINE_KEYS
FINETUNING = ("full", "lora")
# Steps 1-6 with a checkpoint after step 3 (what crash_after_first_checkpoint cuts at).
RUN = ("max_steps=6", "save_strategy=steps", "save_steps=3")
# In `make test`: every engine, both tied families, full and LoRA each at least twice.
SLICE = {("qwen3", "zero3", "full"), ("qwen3", "fsdp2", "lora"), ("gemma3", "fsdp1", "full"),
         ("mistral", "zero2", "full"), ("phi3", "ddp", "lora")}
LOGITS_TOLERANCE = {"rtol": 2e-3, "atol": 2e-3}  # after 6 Adam steps; the losses match to 2e-3 relative


def cases() -> list:
    return [pytest.param(family, engine, finetuning, id=f"{family}-{engine}-{finetuning}",
                         marks=() if (family, engine, finetuning) in SLICE else pytest.mark.matrix)
            for family in FAMILIES for engine in ENGINES for finetuning in FINETUNING]


@pytest.fixture(scope="session")
def one_process(arch_model_dir, tmp_path_factory):
    """``one_process(family, finetuning)``: the output folder of a 1-process run with the global batch, run once."""
    found: dict[tuple[str, str], Path] = {}

    def run(family: str, finetuning: str) -> Path:
        if (family, finetuning) not in found:
            out = tmp_path_factory.mktemp(f"one-{family}-{finetuning}")
            train(arch_model_dir(family), out, finetuning, 1, 4, *RUN)
            found[family, finetuning] = out
        return found[family, finetuning]

    return run


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 40).unsqueeze(0)).logits


def reloaded(out: Path, base: Path, finetuning: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if finetuning == "lora":
        from peft import PeftModel

        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    return AutoModelForCausalLM.from_pretrained(out)


def assert_tied_as_configured(model: torch.nn.Module, folder: Path) -> None:
    """A tied model keeps one matrix: the files hold no separate head, and after reload the head is the embedding."""
    from safetensors import safe_open

    tied = bool(model.config.tie_word_embeddings)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            names.update(handle.keys())
    assert ("lm_head.weight" in names) == (not tied), sorted(names)


@pytest.mark.parametrize(("family", "engine", "finetuning"), cases())
def test_family_under_engine_matches_one_process_saves_and_resumes(family, engine, finetuning, arch_model_dir,
                                                                   one_process, tmp_path):
    base, reference = arch_model_dir(family), one_process(family, finetuning)
    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    results = train(base, finished, finetuning, 2, 2, *RUN, *ENGINES[engine])
    assert results["world_size"] == 2
    assert losses(finished) == pytest.approx(losses(reference), rel=2e-3)

    model = reloaded(finished, base, finetuning)
    torch.testing.assert_close(logits(model), logits(reloaded(reference, base, finetuning)), **LOGITS_TOLERANCE)
    if finetuning == "full":
        assert_tied_as_configured(model, finished)
        exported = tmp_path / "exported"
        result = run_cli("export", str(finished / "checkpoint-6"), "--out", str(exported))
        assert result.returncode == 0, result.stderr[-4000:]
        plain = reloaded(exported, base, finetuning)
        assert_tied_as_configured(plain, exported)
        torch.testing.assert_close(logits(plain), logits(model), rtol=1e-4, atol=1e-5)

    crash_after_first_checkpoint(finished, crashed)
    train(base, crashed, finetuning, 2, 2, *RUN, *ENGINES[engine], "overwrite_output_dir=false")
    assert_resumed_like_finished(finished, crashed, rel=1e-3)
    # The resumed run's save passed its own check (a tie lost on resume is two matrices: refused) and holds the
    # uninterrupted run's model.
    torch.testing.assert_close(logits(reloaded(crashed, base, finetuning)), logits(model), **LOGITS_TOLERANCE)
