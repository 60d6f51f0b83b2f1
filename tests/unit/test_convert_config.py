"""`shardtune convert-config`: every key of a LLaMA-Factory file reported as honoured, mapped, refused or unknown."""

from __future__ import annotations

import yaml

from shardtune.cli import main
from shardtune.config.load import build_config

LF_FILE = {
    "model_name_or_path": "org/model", "stage": "sft", "finetuning_type": "lora", "dataset": "identity",
    "output_dir": "saves/run", "evaluation_strategy": "steps", "lora_rnak": 8, "save_on_each_node": True,
}


def test_each_key_is_reported_with_its_status(tmp_path, capsys):
    path = tmp_path / "lf.yaml"
    path.write_text(yaml.safe_dump(LF_FILE, sort_keys=False))
    assert main(["convert-config", str(path)]) == 2  # a refused and an unknown key: it would not run as it is
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "honoured  model_name_or_path"
    assert "mapped    evaluation_strategy: -> eval_strategy (its newer name)" in lines
    assert any(line.startswith("unknown   lora_rnak:") and "did you mean 'lora_rank'" in line for line in lines)
    assert any(line.startswith("refused   save_on_each_node:") for line in lines)
    assert "5 honoured, 1 mapped, 1 refused, 1 unknown" in lines


def test_the_rewritten_file_is_the_same_run_in_shardtune_spelling(tmp_path, capsys):
    values = {k: v for k, v in LF_FILE.items() if k not in ("lora_rnak", "save_on_each_node")}
    path, out = tmp_path / "lf.yaml", tmp_path / "st.yaml"
    path.write_text(yaml.safe_dump(values))
    assert main(["convert-config", str(path), "--out", str(out)]) == 0
    rewritten = yaml.safe_load(out.read_text())
    assert "evaluation_strategy" not in rewritten and rewritten["eval_strategy"] == "steps"
    assert build_config(rewritten) == build_config(values)
    assert "0 refused, 0 unknown" in capsys.readouterr().out


def test_values_that_would_be_refused_are_listed(tmp_path, capsys):
    values = {k: v for k, v in LF_FILE.items() if k not in ("lora_rnak", "save_on_each_node")}
    path = tmp_path / "lf.yaml"
    path.write_text(yaml.safe_dump({**values, "cutoff_len": -3}))
    assert main(["convert-config", str(path)]) == 2
    assert any(line.startswith("problem: ") and "cutoff_len" in line for line in capsys.readouterr().out.splitlines())


def test_a_mapped_key_is_refused_only_for_the_value_shardtune_refuses(tmp_path, capsys):
    values = {k: v for k, v in LF_FILE.items() if k not in ("lora_rnak", "save_on_each_node")}
    path = tmp_path / "lf.yaml"
    path.write_text(yaml.safe_dump({**values, "save_safetensors": False}))
    assert main(["convert-config", str(path)]) == 2
    lines = capsys.readouterr().out.splitlines()
    refused = [line for line in lines if line.startswith("refused   save_safetensors:")]
    assert refused and "writes models only as safetensors" in refused[0]
    assert "5 honoured, 1 mapped, 1 refused, 0 unknown" in lines
    path.write_text(yaml.safe_dump({**values, "save_safetensors": True}))
    assert main(["convert-config", str(path)]) == 0
    assert any(line.startswith("mapped    save_safetensors:") for line in capsys.readouterr().out.splitlines())
