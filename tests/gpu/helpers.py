"""Shared by the GPU tests: one training run through the real CLI on the tiny model, and checks of its outputs."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.distributed.helpers import COMMON, losses

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# Autocast (torch engines) and DeepSpeed's bf16 module differ in rounding; a lost or doubled micro-batch, a wrong
# token normalisation or a rank that trained alone moves the tiny model's losses by several percent.
BF16_RTOL = 1e-2
MICRO = 2  # per process; the single-process reference runs MICRO x GPUS


def needs_gpu() -> list:
    return [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]


@dataclass
class Run:
    out: Path
    results: dict
    process: subprocess.CompletedProcess

    @property
    def losses(self) -> list[float]:
        return losses(self.out)


def train(model: Path, out: Path, finetuning: str, *extra: str, processes: int = 0, micro: int = MICRO) -> Run:
    """``shardtune train`` in bf16; ``processes`` > 0 launches through torchrun (FORCE_TORCHRUN) with that many."""
    env = {"NCCL_DEBUG": "VERSION", "NCCL_DEBUG_FILE": str(out / "nccl.%h.%p.log")}
    if processes:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(processes))
    out.mkdir(parents=True, exist_ok=True)
    done = run_cli("train", *COMMON, "bf16=true", f"model_name_or_path={model}", f"output_dir={out}",
                   f"finetuning_type={finetuning}", f"per_device_train_batch_size={micro}", *extra, timeout=900, **env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return Run(out, json.loads((out / "train_results.json").read_text()), done)


def used_nccl(run: Run) -> bool:
    """The process group ran on NCCL: the run says so, or NCCL announced itself (NCCL_DEBUG=VERSION)."""
    if "backend" in run.results:
        return run.results["backend"] == "nccl"
    logs = [p.read_text(errors="replace") for p in run.out.glob("nccl.*.log")]
    return any("NCCL version" in text for text in [*logs, run.process.stdout, run.process.stderr])


def check_memory_records(results: dict, world_size: int) -> None:
    """Peak memory per rank is recorded; the set-up peak too, where this version of shardtune records it."""
    for key in ("peak_memory_bytes_per_rank", "peak_setup_memory_bytes_per_rank"):
        if key == "peak_setup_memory_bytes_per_rank" and key not in results:
            continue
        values = results[key]
        assert len(values) == world_size and min(values) > 0, (key, values)


def check_full_model_saved(out: Path, base: Path) -> None:
    """Every weight matrix was saved and changed by training (bf16 may round a norm's update away)."""
    from transformers import AutoModelForCausalLM

    saved = dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).named_parameters())
    start = dict(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).named_parameters())
    assert saved.keys() == start.keys()
    unchanged = [n for n, p in saved.items() if p.dim() >= 2 and torch.equal(p, start[n])]
    assert not unchanged, f"saved weights equal the untrained ones: {unchanged[:3]}"


def check_adapter_saved(out: Path, base: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b), "adapter weights are empty"
