"""enable_liger_kernel: its spellings (LLaMA-Factory's flat key, the Trainer's name, v1's kernel_config) turn it on,
and a rank without a CUDA GPU or liger-kernel refuses with one line. The GPU tier (tests/gpu/test_kernels_gpu.py)
compares a run with Liger's kernels to one without."""

from __future__ import annotations

import pytest
import torch

from shardtune.config.lf_v1 import translate_file_values
from shardtune.config.load import build_config
from shardtune.model.liger import LOSS_SWITCHES, liger_device_problem, liger_importable
from tests.conftest import run_cli


def test_the_flat_key_and_the_trainers_name_turn_it_on():
    assert build_config({"enable_liger_kernel": True}).enable_liger_kernel
    assert build_config({"use_liger_kernel": True}).enable_liger_kernel
    assert not build_config({}).enable_liger_kernel


def test_v1_kernel_config_liger_kernel_turns_it_on_and_refuses_unknown_settings():
    values, problems = translate_file_values({"model": "m", "kernel_config": {"name": "liger_kernel"}})
    assert not problems and values["enable_liger_kernel"] is True
    values, problems = translate_file_values({"model": "m", "kernel_config": {"name": "auto"}})
    assert not problems and "enable_liger_kernel" not in values
    values, problems = translate_file_values({"model": "m", "kernel_config": {"name": "liger_kernel",
                                                                              "use_kernels": "auto"}})
    assert not problems and values["enable_liger_kernel"] is True
    _, problems = translate_file_values({"model": "m", "kernel_config": {"name": "liger_kernel",
                                                                         "use_kernels": ["rms_norm"]}})
    assert problems and "kernel_config.use_kernels" in problems[0], problems


def test_a_rank_without_cuda_or_liger_says_why_in_one_line():
    assert liger_device_problem(False, True) == (
        "enable_liger_kernel (true) needs a CUDA GPU (Liger's kernels are Triton GPU kernels); none is visible here. "
        "Remove enable_liger_kernel")
    assert liger_device_problem(True, False) == ("enable_liger_kernel (true) needs the liger-kernel package: pip "
                                                 "install liger-kernel (it needs triton and a CUDA GPU)")
    assert liger_device_problem(True, True) is None


@pytest.mark.skipif(not liger_importable(), reason="liger-kernel (and triton) not installed")
def test_the_llama_patch_replaces_norms_rope_and_mlp_and_leaves_the_loss_alone():
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    from shardtune.model.liger import kernels_switched_on

    assert kernels_switched_on(apply_liger_kernel_to_llama) == ("rope", "rms_norm", "swiglu")
    assert set(LOSS_SWITCHES) <= set(__import__("inspect").signature(apply_liger_kernel_to_llama).parameters)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a rank without CUDA")
def test_training_on_a_cpu_refuses_in_one_line_after_check_passed(tiny_model_dir, tmp_path):
    args = ("examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path}",
            "enable_liger_kernel=true", "max_steps=1")
    assert run_cli("check", *args).returncode == 0
    done = run_cli("train", *args)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "shardtune: error: enable_liger_kernel (true) needs a CUDA GPU (Liger's kernels are Triton GPU kernels); "
        "none is visible here. Remove enable_liger_kernel")
