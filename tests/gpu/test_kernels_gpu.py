"""fp8 (torchao float8) and enable_liger_kernel on the GPU, through the real CLI: 3 steps each against the same run in
bf16 without them. The model is the tiny LLaMA widened so that every projection is a multiple of 16 (float8's
matmul needs it), else fp8 would keep every layer in bf16 and compare bf16 with itself."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.gpu.helpers import BF16_RTOL, GPUS, MICRO, needs_gpu, train

pytestmark = [*needs_gpu(), pytest.mark.timeout(1200)]
STEPS = ("max_steps=3",)
# Float8 rounds every input, weight and output gradient of the swapped layers to 3-4 significant bits before scaling;
# on the tiny model that moves the loss by about a percent, while a layer that computed garbage moves it by far more.
FP8_RTOL = 3e-2


def float8_gpu() -> bool:
    return GPUS > 0 and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(scope="module")
def aligned_model(tmp_path_factory):
    from shardtune.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-aligned", hidden=128, intermediate=256,
                            layers=2, heads=4)


@pytest.fixture(scope="module")
def bf16_run(aligned_model, tmp_path_factory):
    return train(aligned_model, tmp_path_factory.mktemp("bf16"), "full", *STEPS)


@pytest.mark.skipif(not float8_gpu(), reason="needs a GPU of compute capability 8.9+ (float8 tensor cores)")
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_fp8_trains_three_steps_close_to_bf16(aligned_model, bf16_run, tmp_path):
    run = train(aligned_model, tmp_path, "full", *STEPS, "fp8=true")
    assert "Linear layers train in float8" in run.process.stdout, run.process.stdout[-2000:]
    assert all(math.isfinite(x) for x in run.losses)
    assert run.losses != bf16_run.losses  # the float8 layers ran
    assert run.losses == pytest.approx(bf16_run.losses, rel=FP8_RTOL)


@pytest.mark.skipif(not float8_gpu(), reason="needs a GPU of compute capability 8.9+ (float8 tensor cores)")
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_fp8_under_fsdp2_with_float8_all_gather(aligned_model, bf16_run, tmp_path):
    processes = min(GPUS, 2)
    run = train(aligned_model, tmp_path, "full", *STEPS, "fsdp=full_shard auto_wrap",
                "fp8_enable_fsdp_float8_all_gather=true", processes=processes, micro=MICRO // processes)
    assert "float8 all-gather under FSDP2" in run.process.stdout + run.process.stderr
    assert run.losses == pytest.approx(bf16_run.losses, rel=FP8_RTOL)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
def test_liger_kernels_give_the_losses_of_the_plain_model(aligned_model, bf16_run, tmp_path):
    run = train(aligned_model, tmp_path, "full", *STEPS, "enable_liger_kernel=true")
    assert "Liger's kernels replaced rope, rms_norm, swiglu of llama" in run.process.stdout, run.process.stdout[-2000:]
    assert run.losses == pytest.approx(bf16_run.losses, rel=BF16_RTOL)
