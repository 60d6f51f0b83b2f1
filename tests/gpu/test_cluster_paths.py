"""GPU paths no CPU test reaches (issue 23's review): FSDP2 with its shards offloaded to the host, an fp16 ZeRO
checkpoint saved and resumed, one GPU per process. Each runs the real CLI over NCCL on the GPUs of this machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import COMMON, losses
from tests.gpu.helpers import BF16_RTOL, GPUS, MICRO, check_full_model_saved, needs_gpu

pytestmark = [*needs_gpu(), pytest.mark.timeout(1200)]


def common_with(**values: object) -> list[str]:
    """COMMON with some of its keys given other values (each key once on the command line)."""
    return [a for a in COMMON if a.split("=", 1)[0] not in values] + [f"{k}={v}" for k, v in values.items()]


def train_on_gpus(model: Path, out: Path, *extra: str, **values: object):
    return run_cli("train", *common_with(**values), f"model_name_or_path={model}", f"output_dir={out}",
                   f"per_device_train_batch_size={MICRO}", *extra, timeout=900, FORCE_TORCHRUN="1",
                   NPROC_PER_NODE=str(GPUS), NCCL_DEBUG="VERSION")


def test_fsdp2_offload_trains_saves_and_matches_one_process(bf16_reference, tiny_model_dir, tmp_path):
    """CPU offload: clipping and the full-state gather run collectives on host tensors, which an NCCL-only process
    group refuses (torch issue 148532); the group has gloo for them."""
    done = train_on_gpus(tiny_model_dir, tmp_path, "bf16=true", "finetuning_type=full",
                         "fsdp=full_shard auto_wrap offload", save_strategy="steps", save_steps=2, max_grad_norm=1.0)
    assert done.returncode == 0, done.stderr[-5000:]
    assert json.loads((tmp_path / "train_results.json").read_text())["engine"] == "fsdp"
    assert losses(tmp_path) == pytest.approx(bf16_reference["full"].losses, rel=BF16_RTOL)
    assert any(tmp_path.glob("checkpoint-*/COMPLETE"))
    check_full_model_saved(tmp_path, tiny_model_dir)


def test_fp16_zero_checkpoint_resumes(tiny_model_dir, tmp_path):
    """DeepSpeed's fp16 optimizer state holds its DynamicLossScaler: the safe loader must read it back."""
    values = {"save_strategy": "steps", "save_steps": 2, "overwrite_output_dir": "false"}
    first = train_on_gpus(tiny_model_dir, tmp_path, "fp16=true", "deepspeed=z2", max_steps=4, **values)
    assert first.returncode == 0, first.stderr[-5000:]
    assert (tmp_path / "checkpoint-4").is_dir()
    # A finished run goes on only when asked to (output_dir's guard): from its last checkpoint.
    second = train_on_gpus(tiny_model_dir, tmp_path, "fp16=true", "deepspeed=z2", max_steps=6,
                           resume_from_checkpoint=tmp_path / "checkpoint-4", **values)
    assert second.returncode == 0, second.stderr[-5000:]
    assert "resuming from" in second.stdout and "checkpoint-4" in second.stdout
    assert json.loads((tmp_path / "train_results.json").read_text())["global_step"] == 6


def test_a_rank_given_one_gpu_takes_it_whatever_its_local_rank(tiny_model_dir, tmp_path):
    """What srun --gpus-per-task=1 gives a rank: LOCAL_RANK 1 and one visible GPU. The rank trains on the GPU it
    sees instead of failing with "invalid device ordinal"."""
    done = run_cli("train", *COMMON, f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path}",
                   "finetuning_type=lora", "bf16=true", timeout=900, RANK="0", WORLD_SIZE="1", LOCAL_RANK="1",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", CUDA_VISIBLE_DEVICES="0")
    assert done.returncode == 0, done.stderr[-5000:]
    assert json.loads((tmp_path / "train_results.json").read_text())["global_step"] > 0


@pytest.mark.parametrize(("precision", "engine", "expected"), [
    ("bf16=true", (), "eager"),  # DDP: fp32 weights under autocast
    ("bf16=false", (), "eager"),  # fp32 training
    ("bf16=true", ("fsdp=full_shard auto_wrap",), "grouped_mm"),  # bf16 weights in forward
])
def test_moe_fused_experts_train_on_the_gpu(precision, engine, expected, arch_model_dir, tmp_path):
    """transformers' grouped_mm fuses bf16 experts only: the run says which implementation the experts use, and
    trains."""
    done = train_on_gpus(arch_model_dir("qwen3_moe"), tmp_path, precision, "finetuning_type=full", *engine)
    assert done.returncode == 0, done.stderr[-5000:]
    assert f"mixture of experts: experts_implementation {expected}" in done.stdout
    assert len(losses(tmp_path)) > 0
