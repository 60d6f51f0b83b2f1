"""A LLaMA-Factory file for a back-end or variant shardtune does not run says so, in the first line for back-ends."""

from __future__ import annotations

import pytest
import yaml

from shardtune.config.args import read_config
from shardtune.config.load import build_config
from shardtune.errors import ConfigError

BASE = {"model_name_or_path": "org/model", "dataset": "demo", "output_dir": "out"}


@pytest.mark.parametrize("value", [False, True])
def test_use_v1_kernels_selects_no_kernels_off_an_npu_as_in_llamafactory(value):
    # LLaMA-Factory's use_v1_kernels applies its v1 "auto" kernel set, defined for Ascend NPUs only: on a CUDA GPU
    # or a CPU it changes nothing, so either value trains the same model.
    assert build_config({**BASE, "use_v1_kernels": value}) == build_config(BASE)


def test_convert_config_says_what_use_v1_kernels_does():
    from shardtune.config.compat import MAPPED

    assert "Ascend NPUs only" in MAPPED["use_v1_kernels"].becomes


@pytest.mark.parametrize(("key", "value", "backend"), [
    ("tensor_model_parallel_size", 2, "Megatron-Core"),
    ("use_kt", True, "KTransformers"),
])
def test_the_first_problem_of_a_file_for_another_backend_names_it(tmp_path, key, value, backend):
    # Problems listed before it in the file (an audio key, an unknown key) come after it in the refusal.
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**BASE, "audio_sampling_rate": 16000, "lora_rnak": 8, key: value},
                                   sort_keys=False))
    _, _, problems = read_config([str(path)])
    assert backend in problems[0].text and len(problems) == 3


# DFT, EAFT, ASFT, LLaMA-Pro, OFT and mixture of depths are built (tests/unit/test_token_weighting.py,
# tests/unit/test_asft_loss.py, tests/unit/test_llama_pro.py, tests/unit/test_oft.py, tests/unit/test_depths.py).
@pytest.mark.parametrize(("key", "variant"), [("early_stopping_steps", "early stopping")])
def test_each_unimplemented_variant_is_named(key, variant):
    with pytest.raises(ConfigError, match=f"key '{key}' is not supported by shardtune: .*{variant}"):
        build_config({**BASE, key: 3})


@pytest.mark.parametrize(("optim", "instead"), [("paged_ademamix_8bit", "paged_adamw_8bit"),
                                                ("paged_lion_32bit", "adamw_torch"), ("lion_8bit", "adamw_torch")])
def test_ademamix_and_lion_optimizers_name_what_to_use(optim, instead):
    with pytest.raises(ConfigError, match=f"optim: '{optim}' is not supported by shardtune: .*{instead}"):
        build_config({**BASE, "optim": optim})


# fp8 (torchao's float8) is built: tests/unit/test_fp8.py; Transformer Engine and MS-AMP are named there.
def test_fp8_backends_other_than_torchao_name_it():
    from shardtune.model.fp8 import float8_key_problems

    problems = float8_key_problems(build_config({**BASE, "fp8": True, "bf16": True, "finetuning_type": "full",
                                                 "fp8_backend": "te"}))
    assert problems and "fp8_backend (te)" in problems[0] and "fp8_backend: torchao" in problems[0]
