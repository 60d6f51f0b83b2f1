"""Activation checkpointing under every engine: on 2 gloo processes, DDP, ZeRO-2, ZeRO-3, FSDP2 and FSDP1, full
fine-tuning and LoRA (which needs the input-gradient hook), train the same losses with checkpointing on and off,
and checkpointing lowers each rank's measured peak memory. The estimate follows the switch.

The model is wide and deep enough for activations to dominate a step (hidden 256, 6 layers, 1024-token packed rows,
4 rows per rank), as in the single-process test in tests/e2e/test_lf_outputs.py.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import ENGINE_KEYS, losses

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

ENGINES = ENGINE_KEYS
IN_MAKE_TEST = {("zero3", "lora"), ("fsdp2", "full")}  # the rest run in `make test-matrix`
CASES = [pytest.param(engine, finetuning, id=f"{engine}-{finetuning}",
                      marks=() if (engine, finetuning) in IN_MAKE_TEST else pytest.mark.matrix)
         for engine in ENGINES for finetuning in ("full", "lora")]
# One decoder layer's activations kept instead of six, per rank: ~300 MiB or more in this regime on one process
# (tests/e2e/test_lf_outputs.py); allocator and sharding noise is far below this.
MIN_SAVING = 150 * 2**20


def run(model, out, engine: str, finetuning: str, checkpointing: bool) -> dict:
    result = run_cli("train", "examples/tiny/pt_full.yaml", f"model_name_or_path={model}", f"output_dir={out}",
                     f"finetuning_type={finetuning}", f"gradient_checkpointing={str(checkpointing).lower()}",
                     "cutoff_len=1024", "per_device_train_batch_size=4", "max_steps=2", "logging_steps=1",
                     "save_strategy=no", "plot_loss=false", "lora_target=all", *ENGINES[engine],
                     FORCE_TORCHRUN="1", NPROC_PER_NODE="2", timeout=800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((out / "train_results.json").read_text())


@pytest.mark.parametrize(("engine", "finetuning"), CASES)
def test_checkpointing_keeps_losses_and_lowers_peak_memory(engine, finetuning, wider_model_dir, tmp_path):
    plain = run(wider_model_dir, tmp_path / "plain", engine, finetuning, False)
    checkpointed = run(wider_model_dir, tmp_path / "checkpointed", engine, finetuning, True)
    assert plain["engine"] == checkpointed["engine"] and checkpointed["world_size"] == 2
    assert losses(tmp_path / "checkpointed") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)
    saved = [a - b for a, b in zip(plain["peak_memory_bytes_per_rank"], checkpointed["peak_memory_bytes_per_rank"],
                                   strict=True)]
    print(f"{engine} {finetuning}: peak MiB per rank plain {[b >> 20 for b in plain['peak_memory_bytes_per_rank']]}"
          f", checkpointed {[b >> 20 for b in checkpointed['peak_memory_bytes_per_rank']]}")
    assert min(saved) > MIN_SAVING, saved
    # The estimate follows the switch: it predicts a saving of the same kind.
    assert checkpointed["estimated_memory_bytes"] < plain["estimated_memory_bytes"]
