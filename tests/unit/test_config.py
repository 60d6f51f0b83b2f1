"""Config loading: types, choices, ranges, unknown and unsupported keys, cross-key rules, the command line."""

from __future__ import annotations

import textwrap

import pytest

from shardtune.config.args import load_config, parse_command_line
from shardtune.config.load import build_config, load_yaml_file
from shardtune.config.schema import TrainConfig, key_names
from shardtune.errors import ConfigError
from shardtune.launch.validate import cross_key_problems, validate_config

BASE = {"model_name_or_path": "org/model", "dataset": "demo", "output_dir": "out"}


def problems_of(values: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build_config(values)
    return info.value.problems


def test_defaults_and_conversion():
    config = build_config({**BASE, "learning_rate": "1e-4", "lora_rank": "16", "bf16": "true",
                           "dataset": "a, b", "quantization_bit": "null"})
    assert config.learning_rate == pytest.approx(1e-4)
    assert config.lora_rank == 16 and config.bf16 is True
    assert config.dataset == ["a", "b"]
    assert config.quantization_bit is None
    assert config.trust_remote_code is False
    assert config.finetuning_type == "lora"


def test_unknown_key_suggests_the_right_one():
    assert problems_of({**BASE, "lerning_rate": 1e-4}) == [
        "config: unknown key 'lerning_rate' (did you mean 'learning_rate'?)"]


def test_unsupported_training_argument_is_refused_by_name():
    (problem,) = problems_of({**BASE, "torchdynamo": "inductor"})
    assert "torchdynamo" in problem and "not supported" in problem


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("learning_rate", "fast", "learning_rate: expected a number, got 'fast'"),
        ("lora_rank", 1.5, "lora_rank: expected an integer"),
        ("bf16", "maybe", "bf16: expected true/false"),
        ("lora_rank", 0, "lora_rank: 0 is out of range; it must be >= 1"),
        ("learning_rate", 0, "learning_rate: 0.0 is out of range; it must be > 0"),
        ("warmup_ratio", 1.5, "warmup_ratio: 1.5 is out of range; it must be <= 1"),
        ("stage", "ppo", "stage: 'ppo' is not allowed; choose one of: sft, pt, dpo, kto, rm"),
        ("finetuning_type", "qlora", "finetuning_type: 'qlora' is not allowed; choose one of: lora, full, freeze"),
        ("quantization_bit", 3, "quantization_bit: 3 is not allowed; choose one of: 4, 8, null"),
        ("lr_scheduler_type", "cosin", "lr_scheduler_type: 'cosin' is not allowed"),
        ("dataset", {"a": 1}, "dataset: expected a list"),
    ],
)
def test_wrong_type_or_value_names_key_value_and_allowed(key, value, fragment):
    (problem,) = problems_of({**BASE, key: value})
    assert fragment in problem


def test_all_problems_reported_together():
    problems = problems_of({**BASE, "lerning_rate": 1, "lora_rank": "x", "stage": "ppo", "use_cpu": True})
    assert len(problems) == 4


def test_cross_key_rules_name_both_keys():
    config = build_config({**BASE, "bf16": True, "fp16": True, "quantization_bit": 4, "finetuning_type": "full",
                           "do_eval": True})
    joined = "\n".join(cross_key_problems(config))
    assert "bf16 (true) and fp16 (true)" in joined
    assert "quantization_bit (4) needs finetuning_type: lora" in joined
    assert "needs val_size > 0" in joined


def test_required_keys():
    joined = "\n".join(cross_key_problems(TrainConfig()))
    for key in ("model_name_or_path", "output_dir", "dataset"):
        assert f"{key} is required" in joined


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("stage: sft\nlearning_rate: [1e-4\nseed: 3\n")
    with pytest.raises(ConfigError) as info:
        load_yaml_file(path)
    assert f"{path}:3" in info.value.problems[0] or f"{path}:2" in info.value.problems[0]


def test_yaml_top_level_must_be_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml_file(path)


def test_command_line_overrides_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent("""
        model_name_or_path: org/model
        dataset: demo
        output_dir: out
        learning_rate: 1.0e-4
    """))
    config, cmd = load_config([str(path), "learning_rate=2e-4", "--lora_rank", "4", "--bf16",
                               "--local_rank=1", "--dry-run", "--num_train_epochs=2"])
    assert config.learning_rate == pytest.approx(2e-4)
    assert config.lora_rank == 4 and config.bf16 and config.num_train_epochs == 2.0
    assert cmd.switches == {"dry_run"}


def test_flags_only_without_yaml():
    config, _ = load_config(["--stage", "pt", "--model_name_or_path", "org/m", "--dataset", "demo_pt",
                             "--output_dir", "o", "--plot_loss", "false"])
    assert config.stage == "pt" and config.plot_loss is False and config.dataset == ["demo_pt"]


def test_deepspeed_launcher_local_rank_does_not_hide_the_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: org/m\n")
    cmd = parse_command_line(["--local_rank=0", str(path)])
    assert cmd.config_path == str(path)
    cmd = parse_command_line(["--local-rank", "3", str(path), "seed=1"])
    assert cmd.config_path == str(path) and cmd.values == {"seed": 1}


def test_key_value_whose_value_is_a_json_file_is_an_override_not_a_config():
    cmd = parse_command_line(["cfg.yaml", "deepspeed=examples/deepspeed/ds_z2_config.json", "fsdp_config=f.yaml"])
    assert cmd.config_path == "cfg.yaml"
    assert cmd.values == {"deepspeed": "examples/deepspeed/ds_z2_config.json", "fsdp_config": "f.yaml"}
    assert parse_command_line(["runs/a=b.yaml"]).config_path == "runs/a=b.yaml"


def test_output_dir_with_finished_run_needs_overwrite(tmp_path):
    (tmp_path / "train_results.json").write_text("{}")
    config = build_config({**BASE, "output_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="overwrite_output_dir"):
        validate_config(config)
    validate_config(build_config({**BASE, "output_dir": str(tmp_path), "overwrite_output_dir": True}))


def test_missing_local_model_dir(tmp_path):
    config = build_config({**BASE, "model_name_or_path": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="folder not found"):
        validate_config(config)
    (tmp_path / "m").mkdir()
    config = build_config({**BASE, "model_name_or_path": str(tmp_path / "m")})
    with pytest.raises(ConfigError, match="has no config.json"):
        validate_config(config)


def test_every_key_has_doc_and_group():
    from shardtune.config.schema import config_fields

    for f in config_fields():
        assert f.metadata["doc"], f.name
    assert len(key_names()) == len(set(key_names()))


def test_yaml_no_for_strategy_keys():
    config = build_config({**BASE, "save_strategy": False, "eval_strategy": "no"})
    assert config.save_strategy == "no" and config.eval_strategy == "no"
