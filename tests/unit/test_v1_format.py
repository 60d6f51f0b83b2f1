"""LLaMA-Factory's v1 format (USE_V1=1): refused with that reason on the first line, each v1 key named with the flat
key that does its work; `use_v1_kernels: false` in a flat file accepted. The fixture has the keys and values of
LLaMA-Factory's examples/v1/train_lora/train_lora_sft.yaml (the model and data replaced by local names)."""

from __future__ import annotations

import pytest
import yaml

from shardtune.cli import main
from shardtune.config.load import build_config
from shardtune.config.v1_format import V1_KEYS, v1_keys
from shardtune.errors import ConfigError
from tests.conftest import run_cli

V1_LORA_SFT = {
    "model": "{MODEL}", "model_class": "llm",
    "peft_config": {"name": "lora", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all"},
    "kernel_config": {"name": "auto"},
    "dist_config": {"name": "fsdp2", "dcp_path": None},
    "train_dataset": "data/v1_sft_demo.yaml",
    "output_dir": "{OUTPUT}", "micro_batch_size": 1, "cutoff_len": 2048, "learning_rate": 1.0e-4, "max_steps": 10,
    "sample_backend": "hf", "max_new_tokens": 128,
}
V1_ONLY = ["model", "model_class", "peft_config", "kernel_config", "dist_config", "train_dataset", "micro_batch_size",
           "sample_backend"]


def write(tmp_path, values, model) -> str:
    text = yaml.safe_dump(values, sort_keys=False).replace("'{MODEL}'", str(model))
    path = tmp_path / "cfg.yaml"
    path.write_text(text.replace("'{OUTPUT}'", str(tmp_path / "out")))
    return str(path)


def test_a_v1_file_is_refused_as_v1_first_then_each_key_with_its_flat_key(tmp_path, tiny_model_dir, capsys):
    assert main(["check", write(tmp_path, V1_LORA_SFT, tiny_model_dir)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtune: error:")]
    assert "this is LLaMA-Factory's v1 format (run with USE_V1=1" in errors[0]
    for key in V1_ONLY:
        line = next(e for e in errors if f"v1 key '{key}'" in e)
        assert "did you mean" not in line, line
    assert any("'micro_batch_size': use per_device_train_batch_size" in e for e in errors)
    assert any("'model': use model_name_or_path" in e for e in errors)
    assert not any("output_dir" in e or "learning_rate" in e for e in errors)  # keys of both formats pass


def test_every_v1_key_has_an_instruction_and_flat_files_are_not_taken_for_v1():
    assert all(v1_keys({key: 1, "model_class": "llm"}) for key in V1_KEYS)
    # flash_attn and cp_size are keys of both formats; a flat LLaMA-Factory file has none of the v1 markers
    assert v1_keys({"model_name_or_path": "m", "flash_attn": "fa2", "cp_size": 2, "model": "x"}) == []
    with pytest.raises(ConfigError) as err:
        build_config({"model": "m", "dist_config": {"name": "fsdp2"}}, source="cfg.yaml")
    assert err.value.problems[0].startswith("cfg.yaml: this is LLaMA-Factory's v1 format")


def test_convert_config_reports_v1_keys(tmp_path, tiny_model_dir, capsys):
    assert main(["convert-config", write(tmp_path, V1_LORA_SFT, tiny_model_dir)]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert "LLaMA-Factory's v1 format" in lines[0]
    assert any(line.startswith("v1        dist_config:") and "fsdp" in line for line in lines)
    assert "5 honoured, 0 mapped, 0 refused, 0 unknown, 8 v1" in lines


@pytest.mark.parametrize(("value", "accepted"), [(False, True), (True, False)])
def test_use_v1_kernels_false_is_accepted_and_true_refused_with_its_reason(value, accepted):
    values = {"model_name_or_path": "m", "output_dir": "o", "dataset": "d", "use_v1_kernels": value}
    if accepted:
        assert build_config(values).model_name_or_path == "m"
        return
    with pytest.raises(ConfigError, match="LLaMA-Factory's v1 kernel plugins are not used by shardtune"):
        build_config(values)


def test_use_v1_in_the_environment_changes_nothing(tiny_model_dir, tmp_path):
    result = run_cli("check", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}",
                     f"output_dir={tmp_path / 'out'}", USE_V1="1")
    assert result.returncode == 0, result.stderr[-2000:]
