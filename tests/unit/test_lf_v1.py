"""LLaMA-Factory's v1 format (`USE_V1=1`): its keys and plugin sections read into shardtune's, with v1's defaults;
a v1 setting with no counterpart refused with a first line that names the v1 format."""

from __future__ import annotations

import json

import pytest
import yaml

from shardtune.cli import main
from shardtune.config.lf_v1 import V1_PREFIX, is_v1_file, translate_v1, v1_defaults_for_file
from shardtune.config.load import build_config
from tests.conftest import REPO

V1_LORA = {
    "model": "org/model", "model_class": "llm",
    "peft_config": {"name": "lora", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all"},
    "kernel_config": {"name": "auto"}, "quant_config": None, "init_config": {"name": "init_on_rank0"},
    "dist_config": {"name": "fsdp2", "dcp_path": None},
    "output_dir": "out", "micro_batch_size": 2, "cutoff_len": 256, "learning_rate": 1.0e-4, "max_steps": 10,
    "sample_backend": "hf", "max_new_tokens": 128,
}


def test_v1_keys_and_sections_become_shardtune_keys():
    values, problems = translate_v1(V1_LORA)
    assert problems == []
    assert values["model_name_or_path"] == "org/model" and "model" not in values
    assert (values["finetuning_type"], values["lora_rank"], values["lora_alpha"], values["lora_target"]) == (
        "lora", 16, 32, "all")
    assert values["fsdp"] == "full_shard" and values["per_device_train_batch_size"] == 2
    assert values["cutoff_len"] == 256 and values["max_new_tokens"] == 128


def test_keys_a_v1_file_leaves_out_take_v1_defaults():
    """Without a peft_config v1 trains every weight, in bf16, with AdamW's own weight decay and a constant learning
    rate, on the tokenizer's chat template; shardtune's defaults differ in each, so they are filled in."""
    config = build_config({**translate_v1({"model": "org/model", "output_dir": "out"})[0], "dataset": "demo"})
    assert (config.finetuning_type, config.bf16, config.weight_decay, config.lr_scheduler_type) == (
        "full", True, 0.01, "constant")
    assert (config.template, config.gradient_checkpointing, config.cutoff_len, config.save_strategy) == (
        "auto", True, 2048, "no")
    given, _ = translate_v1({"model": "m", "bf16": False, "save_steps": 5})
    assert given["bf16"] is False and given["save_strategy"] == "steps"
    # A default is only named where the file leaves it to v1 (muon's own weight decay is not AdamW's).
    left = v1_defaults_for_file({"model": "m", "optim_config": {"name": "muon"}, "cutoff_len": 64})
    assert "weight_decay" not in left and "cutoff_len" not in left and left["finetuning_type"] == "full"


def test_a_v0_file_is_not_read_as_v1():
    assert not is_v1_file({"model_name_or_path": "m", "stage": "sft", "cutoff_len": 8, "flash_attn": "auto"})
    assert is_v1_file({"model": "m"}) and is_v1_file({"micro_batch_size": 1})


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("dist_config", {"name": "fsdpturbo", "ep_size": 0}, "ep_size"),
    ("dist_config", {"name": "fsdpturbo", "ep_dispatcher": "deepep"}, "dist_config.ep_dispatcher"),
    ("kernel_config", {"name": "flash-linear-attention", "chunk_size": 32}, "chunk size 64"),
    ("kernel_config", {"name": "auto, flash-linear-attention", "include_kernels": "chunk_kda"}, "chunk_kda"),
    ("mp_replicate_size", 2, "fsdp: hybrid_shard"),
    ("batching_strategy", "bucketed", "dynamic_padding_free"),
    ("kernel_config", {"name": "liger_kernel", "use_kernels": ["rms_norm"]}, "kernel_config.use_kernels"),
    ("optim_config", {"name": "muon", "momentum": 0.9}, "optim_config.momentum"),
    ("peft_config", {"name": "lora", "use_dora": True}, "peft_config.use_dora"),
    ("lr_scheduler_config", {"name": "cosine"}, "lr_scheduler_type"),
    ("eval_dataset", "data/v1_sft_demo.yaml", "val_size"),
    ("train_dataset", "data/v1_sft_demo.jsonl", "v1 dataset file"),
])
def test_a_v1_setting_without_counterpart_is_refused_naming_v1(key, value, reason):
    _, problems = translate_v1({"model": "m", key: value})
    assert len(problems) == 1 and problems[0].startswith(f"{V1_PREFIX}: key '{key}")
    assert reason in problems[0]


def test_fsdpturbo_trains_under_fsdp2_with_its_experts_split_over_ep_size_ranks():
    values, problems = translate_v1({"model": "m", "dist_config": {"name": "fsdpturbo", "ep_size": 16,
                                                                    "ep_dispatcher": "eager"}})
    assert problems == [] and values["fsdp"] == "full_shard" and values["expert_parallel_size"] == 16


def test_flash_linear_attention_is_accepted_as_transformers_calls_fla():
    values, problems = translate_v1({"model": "m", "kernel_config": {
        "name": "auto, flash-linear-attention", "chunk_size": 64,
        "include_kernels": "chunk_gated_delta_rule, fused_recurrent_gated_delta_rule"}})
    assert problems == [] and "enable_liger_kernel" not in values
    # transformers' Qwen3.5 layers do call fla's two kernels, by these names, where fla is installed.
    import inspect

    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen35

    source = inspect.getsource(qwen35)
    assert all(f'use_kernel_func_from_hub_with_fallback("{name}", "fla")' in source
               for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"))


def test_train_dataset_names_every_dataset_of_its_v1_file(tmp_path):
    data = tmp_path / "sft.yaml"
    data.write_text("first:\n  path: a.jsonl\n  source: local\nsecond:\n  path: b.jsonl\n  source: local\n")
    values, problems = translate_v1({"model": "m", "train_dataset": str(data)})
    assert problems == [] and values["dataset_dir"] == str(data) and values["dataset"] == ["first", "second"]
    _, problems = translate_v1({"model": "m", "train_dataset": str(tmp_path / "missing.yaml")})
    assert problems[0].startswith(f"{V1_PREFIX}: train_dataset") and "cannot be read" in problems[0]


def write_v1_datasets(tmp_path, **first_records):
    """A v1 dataset file naming one JSON-lines file per dataset, each holding ``first_records[name]``."""
    entries = {}
    for name, record in first_records.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(record) + "\n")
        entries[name] = {"path": str(tmp_path / f"{name}.jsonl"), "source": "local"}
    (tmp_path / "data.yaml").write_text(yaml.safe_dump(entries))
    return str(tmp_path / "data.yaml")


PAIR = {"chosen_messages": [], "rejected_messages": []}
CONVERSATION = {"messages": []}


def test_a_v1_file_of_pairs_trains_dpo_as_llamafactory_cli_dpo_would(tmp_path):
    data = write_v1_datasets(tmp_path, a=PAIR, b=PAIR)
    values, problems = translate_v1({"model": "m", "train_dataset": data})
    assert problems == [] and values["stage"] == "dpo"
    values, problems = translate_v1({"model": "m", "train_dataset": data, "stage": "rm"})
    assert problems == [] and values["stage"] == "rm"
    values, _ = translate_v1({"model": "m", "train_dataset": write_v1_datasets(tmp_path, c=CONVERSATION)})
    assert "stage" not in values


def test_a_v1_file_mixing_pairs_and_conversations_is_refused(tmp_path):
    _, problems = translate_v1({"model": "m", "train_dataset": write_v1_datasets(tmp_path, a=PAIR,
                                                                                 c=CONVERSATION)})
    assert problems[0].startswith(f"{V1_PREFIX}: train_dataset") and "mixes preference pairs (a)" in problems[0]


def test_v1_values_shardtune_does_anyway_are_accepted():
    values, problems = translate_v1({"model": "m", "cp_size": 1, "cp_mode": "ulysses", "mp_replicate_size": 1,
                                     "optim_config": {"name": "muon", "momentum": 0.95, "nesterov": True,
                                                      "ns_steps": 5, "wd": 0.2, "adamw_betas": [0.9, 0.98]},
                                     "batching_strategy": "padding_free", "save_ckpt_as_hf": False})
    assert problems == []
    assert values["use_muon"] is True and values["weight_decay"] == 0.2 and values["adam_beta2"] == 0.98
    assert values["padding_free"] is True


def write_v1(tmp_path, model_dir, **extra) -> str:
    values = {**V1_LORA, "model": str(model_dir), "output_dir": str(tmp_path / "out"), **extra}
    del values["dist_config"]  # one process here
    path = tmp_path / "v1.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return str(path)


def test_check_reads_a_v1_file_with_use_v1_set(tmp_path, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("USE_V1", "1")  # LLaMA-Factory's switch to its v1 launcher: accepted, nothing to switch
    path = write_v1(tmp_path, tiny_model_dir)
    assert main(["check", path, "dataset=demo", f"dataset_dir={REPO / 'data'}"]) == 0
    assert "sft / lora of" in capsys.readouterr().out


def test_check_refusal_of_a_v1_file_starts_with_the_v1_format(tmp_path, tiny_model_dir, capsys):
    path = write_v1(tmp_path, tiny_model_dir, mp_replicate_size=2, lora_rnak=8)
    assert main(["check", path, "dataset=demo", f"dataset_dir={REPO / 'data'}"]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert f"{V1_PREFIX}: key 'mp_replicate_size'" in first


def test_convert_config_reports_a_v1_file(tmp_path, capsys):
    path = tmp_path / "v1.yaml"
    path.write_text(yaml.safe_dump({**V1_LORA, "mp_replicate_size": 2}, sort_keys=False))
    assert main(["convert-config", str(path)]) == 2
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"{V1_PREFIX}: read as v1 reads it") and "bf16: True" in lines[0]
    assert "mapped    model: -> model_name_or_path: 'org/model'" in lines
    assert any(line.startswith("mapped    peft_config: -> finetuning_type: 'lora', lora_rank: 16") for line in lines)
    assert any(line.startswith("refused   mp_replicate_size:") and V1_PREFIX in line for line in lines)
    assert "did you mean" not in out and "unknown   " not in out
