"""The chunked loss under every engine, through the real CLI with 2 processes: each run's per-step losses and
gradient norms equal those of the same run with the full logits (``loss_chunk_size=0``).

The engines shard or gather the output layer differently (ZeRO-3 partitions it and gathers it in the head's
hooks, FSDP unshards it with the root unit), so a wrong gradient of the head or a weight read while sharded
would show in the gradient norm. The chunk size (37) is far below the tokens per micro-batch and divides none
of them, so every micro-batch takes several chunks and a short last one.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import COMMON

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

ENGINES = {
    "ddp": (),
    "deepspeed-z2": ("deepspeed=z2",),
    "deepspeed-z3": ("deepspeed=z3",),
    "fsdp2": ("fsdp=full_shard auto_wrap",),
    "fsdp1": ("fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_version': 1}"),
}
# (engine, finetuning, tied embeddings): each engine, both methods and both head layouts, ZeRO-3 (the head
# partitioned, and gathered by its hooks) with both methods. Full fine-tuning of a tied model under ZeRO-2 and
# ZeRO-3 also checks that the save writes the shared tensor once (its element count is verified).
RUNS = [("ddp", "full", False), ("deepspeed-z2", "lora", False), ("deepspeed-z2", "full", True),
        ("deepspeed-z3", "full", True), ("deepspeed-z3", "lora", True), ("fsdp2", "full", True),
        ("fsdp1", "full", False)]
FALLBACK = "computing the loss from the full logits"


@pytest.fixture(scope="session")
def tied_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with its head tied to the embedding (tie_word_embeddings: true)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir, tie_word_embeddings=True))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    out = tmp_path_factory.mktemp("models") / "tiny-llama-tied"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def run(model: Path, out: Path, finetuning: str, chunk_size: int, *extra: str) -> subprocess.CompletedProcess:
    result = run_cli("train", *COMMON, f"model_name_or_path={model}", f"output_dir={out}",
                     f"finetuning_type={finetuning}", "per_device_train_batch_size=2", "packing=true",
                     f"loss_chunk_size={chunk_size}", *extra, FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def logged(out: Path) -> tuple[list[float], list[float]]:
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if "loss" in r]
    return [r["loss"] for r in steps], [r["grad_norm"] for r in steps]


@pytest.mark.parametrize(("engine", "finetuning", "tied"), RUNS,
                         ids=[f"{e}-{f}-{'tied' if t else 'untied'}" for e, f, t in RUNS])
def test_chunked_loss_matches_full_logits(engine, finetuning, tied, tiny_model_dir, tied_model_dir, tmp_path):
    model = tied_model_dir if tied else tiny_model_dir
    chunked = run(model, tmp_path / "chunked", finetuning, 37, *ENGINES[engine])
    run(model, tmp_path / "full", finetuning, 0, *ENGINES[engine])
    assert FALLBACK not in chunked.stderr + chunked.stdout
    results = json.loads((tmp_path / "chunked" / "train_results.json").read_text())
    assert (results["world_size"], results["engine"]) == (2, engine.split("-")[0].rstrip("12"))
    losses, norms = logged(tmp_path / "chunked")
    full_losses, full_norms = logged(tmp_path / "full")
    assert len(losses) == len(full_losses) > 1 and all(n > 0 for n in norms)
    assert losses == pytest.approx(full_losses, rel=2e-3)
    assert norms == pytest.approx(full_norms, rel=2e-3)
