"""The GPU kernels a config names are checked on the launching host when `train` starts the ranks there: the rank's
own one-line refusal comes before anything launches, and `check` (whose ranks may run elsewhere) still passes."""

from __future__ import annotations

import pytest

from shardtune.config.schema import TrainConfig
from shardtune.launch.kernels_here import local_kernel_problems
from shardtune.launch.preflight import unsaid
from shardtune.model.attention import flash_problem


def config(**values) -> TrainConfig:
    return TrainConfig(model_name_or_path="m", **values)


def test_a_host_without_a_gpu_refuses_each_gpu_kernel_in_one_line():
    problems = local_kernel_problems(config(attn_implementation="flash_attention_2", fp8=True, bf16=True,
                                            enable_liger_kernel=True), visible_gpus=0)
    assert [p.split(" (", 1)[0] for p in problems] == ["attn_implementation", "fp8", "enable_liger_kernel"]
    assert all("none is visible here" in p for p in problems)
    assert local_kernel_problems(config(), visible_gpus=0) == []


@pytest.mark.parametrize(("has_cuda", "installed", "split", "expected"), [
    (False, True, 1, "needs a CUDA GPU; none is visible here"),
    (True, False, 1, "needs the flash-attn package"),
    (True, True, 1, None),
    (False, False, 2, "with sequence_parallel_size (2): the split attention runs sdpa's flash kernel"),
    (True, False, 2, None),  # the split's flash kernel is torch's own: no flash-attn package
])
def test_flash_needs_cuda_and_the_package_unless_rows_are_split(has_cuda, installed, split, expected):
    problem = flash_problem(has_cuda, installed, split)
    assert problem is None if expected is None else expected in problem


def test_a_key_already_refused_is_not_refused_twice():
    said = ["attn_implementation (flash_attention_2; flash_attn: fa2): GptOss has attention sinks ..."]
    assert unsaid(["attn_implementation (flash_attention_2, flash_attn: fa2) needs a CUDA GPU", "fp8 (true) x"],
                  said) == ["fp8 (true) x"]
