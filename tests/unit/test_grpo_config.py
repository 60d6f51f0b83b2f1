"""Stage grpo's keys and rules: every problem on one line naming its key, all at once, exit 2 before any rank."""

from __future__ import annotations

import dataclasses

import pytest

from shardtune.config.grpo import GRPO_KEYS, GRPO_REFUSED, grpo_problems
from shardtune.config.rewards import answer_match, format_match, load_reward_function
from shardtune.config.schema import TrainConfig
from shardtune.errors import ConfigError
from tests.conftest import run_cli

GOOD = dict(stage="grpo", reward_funcs=["tests.grpo_rewards:letter_share"], num_generations=4,
            per_device_train_batch_size=8, max_completion_length=16, cutoff_len=64)


def config(**changes) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), **{**GOOD, **changes})


def test_a_good_config_has_no_problem():
    assert grpo_problems(config()) == []
    assert grpo_problems(config(rollout_backend="vllm_protocol_cpu", vllm_importance_sampling_mode="token_truncate",
                                vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)) == []
    assert grpo_problems(config(vllm_importance_sampling_correction=False)) == []  # off: nothing to do, no harm


@pytest.mark.parametrize(("changes", "named"), [
    ({"reward_funcs": []}, "reward_funcs is required"),
    ({"reward_funcs": ["tests.grpo_rewards:missing"]}, "reward_funcs (tests.grpo_rewards:missing)"),
    ({"reward_funcs": ["no_such_module_xyz:f"]}, "cannot import no_such_module_xyz"),
    ({"reward_funcs": ["tests.grpo_rewards:NOT_A_FUNCTION"]}, "not a function"),
    ({"reward_funcs": ["tests/grpo_rewards.py:letter_share", "nofile.py:f"]}, "no file nofile.py"),
    ({"reward_funcs": ["letter_share"]}, "write module:function"),
    ({"reward_funcs": ["format_match"]}, "needs reward_format_regex"),
    ({"reward_funcs": ["format_match"], "reward_format_regex": "a("}, "reward_format_regex (a(): not a regular"),
    ({"reward_weights": ["1", "2"]}, "reward_weights (2 values)"),
    ({"reward_weights": ["x"]}, "reward_weights: x not a number"),
    ({"num_generations": 3}, "num_generations (3) must divide per_device_train_batch_size (8)"),
    ({"epsilon": 0.3, "epsilon_high": 0.1}, "epsilon_high (0.1) is below epsilon (0.3)"),
    ({"max_completion_length": 64}, "max_completion_length (64) leaves no room"),
    ({"do_sample": False}, "do_sample (false)"),
    ({"packing": True}, "packing (True) with stage grpo"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size (2) with stage grpo"),
    ({"vllm_importance_sampling_mode": "token_mask"},
     "vllm_importance_sampling_mode (token_mask) corrects a generator with weights of its own"),
    ({"rollout_backend": "vllm_protocol_cpu", "vllm_importance_sampling_correction": False,
      "vllm_importance_sampling_clip_max": 2.0}, "(2.0) has no effect with vllm_importance_sampling_correction false"),
    ({"rollout_backend": "vllm_protocol_cpu", "vllm_importance_sampling_clip_min": 2.0,
      "vllm_importance_sampling_clip_max": 1.5}, "vllm_importance_sampling_clip_min (2.0) is above"),
    ({"rollout_backend": "vllm_protocol_cpu", "vllm_importance_sampling_mode": "token_truncate",
      "vllm_importance_sampling_clip_max": None}, "and both are null"),
])
def test_each_problem_names_its_key(changes, named):
    problems = grpo_problems(config(**changes))
    assert any(named in p for p in problems), problems


def test_every_refused_key_is_a_key_and_refused():
    defaults = TrainConfig()
    for key in GRPO_REFUSED:
        default = getattr(defaults, key)
        value = {bool: True, int: 2, float: 0.5, str: "x", list: ["x"]}.get(type(default), True)
        assert any(p.startswith(f"{key} (") for p in grpo_problems(config(**{key: value}))), key


def test_grpo_keys_on_another_stage_are_refused_by_name():
    problems = grpo_problems(dataclasses.replace(TrainConfig(), stage="sft", beta=0.1, num_generations=4))
    assert sorted(problems) == ["beta (0.1) is read by stage grpo only, but stage is sft; remove it or set stage: "
                                "grpo", "num_generations (4) is read by stage grpo only, but stage is sft; remove it "
                                "or set stage: grpo"]
    assert set(GRPO_KEYS) <= {f.name for f in dataclasses.fields(TrainConfig)}


def test_builtin_rewards():
    assert answer_match(["p", "p"], [" 42\n", "41"], answer=["42", "42"]) == [1.0, 0.0]
    assert format_match(["p"] * 2, ["<a>x</a>", "x"], pattern=r"<a>.*</a>") == [1.0, 0.0]
    assert load_reward_function("format_match", r"\d+")(["p"], ["12"]) == [1.0]
    with pytest.raises(ConfigError, match="reward_funcs"):
        load_reward_function("tests.grpo_rewards:missing")


def test_check_reports_every_problem_at_once_and_exits_2(tmp_path):
    result = run_cli("check", "examples/grpo/tiny_letter.yaml", "reward_funcs=tests.grpo_rewards:missing",
                     "num_generations=3", "loss_type=ppo", "packing=true", f"output_dir={tmp_path}")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardtune: error:")]
    for named in ("loss_type", "reward_funcs (tests.grpo_rewards:missing)", "num_generations (3)", "packing (True)"):
        assert any(named in line for line in lines), (named, lines)
    assert "Traceback" not in result.stderr


def test_convert_config_maps_axolotls_and_trls_grpo_keys(tmp_path):
    """axolotl's rl: grpo with its trl: mapping, and TRL's own spellings (booleans for scale_rewards, sequence-level
    ratios for GSPO, module.function reward names) become shardtune's keys; use_vllm: true is refused by name."""
    import yaml

    source = tmp_path / "axolotl.yaml"
    source.write_text(yaml.safe_dump({
        "rl": "grpo", "trl": {"beta": 0.001, "num_generations": 4, "max_completion_length": 12, "use_vllm": False,
                              "reward_funcs": ["examples.grpo.rewards.letter_share"], "reward_weights": [1.0],
                              "scale_rewards": False, "importance_sampling_level": "sequence", "loss_type": "grpo",
                              "epsilon_high": 0.28, "mask_truncated_completions": True}}))
    result = run_cli("convert-config", str(source), "--out", str(tmp_path / "out.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert yaml.safe_load((tmp_path / "out.yaml").read_text()) == {
        "stage": "grpo", "beta": 0.001, "num_generations": 4, "max_completion_length": 12,
        "reward_funcs": ["examples.grpo.rewards:letter_share"], "reward_weights": [1.0], "scale_rewards": "none",
        "loss_type": "gspo", "epsilon_high": 0.28, "mask_truncated_completions": True}
    source.write_text(yaml.safe_dump({"rl": "grpo", "trl": {"vllm_importance_sampling_cap": 2.5}}))
    assert run_cli("convert-config", str(source), "--out", str(tmp_path / "cap.yaml")).returncode == 0
    assert yaml.safe_load((tmp_path / "cap.yaml").read_text()) == {  # TRL's older name for the upper bound
        "stage": "grpo", "vllm_importance_sampling_clip_max": 2.5}
    source.write_text(yaml.safe_dump({"rl": "grpo", "trl": {"use_vllm": True}}))
    result = run_cli("convert-config", str(source))
    assert "refused" in result.stdout and "vLLM back-end of stage grpo is not built yet" in result.stdout


def test_a_reward_model_folder_is_checked_by_its_files(tmp_path):
    from shardtune.config.rewards import reward_model_problems

    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert grpo_problems(config(reward_funcs=[str(tmp_path / "rm")])) == []
    assert "is not a reward model" in reward_model_problems(str(tmp_path / "lm"))[0]
    assert "holds a LoRA adapter" in reward_model_problems(str(tmp_path / "adapter"))[0]
    assert "no readable config.json" in reward_model_problems(str(tmp_path / "empty"))[0]


@pytest.mark.parametrize(("gpus", "has_vllm", "why"), [
    (0, True, "this machine has none"), (1, False, "vllm package is not installed"), (1, True, "not built yet")])
def test_the_vllm_backend_is_refused_in_one_line_naming_the_key(gpus, has_vllm, why):
    from shardtune.config.grpo import rollout_backend_problems

    problems = rollout_backend_problems("vllm", gpus, has_vllm)
    assert len(problems) == 1 and problems[0].startswith("rollout_backend (vllm): ") and why in problems[0]
    assert rollout_backend_problems("transformers", 0, False) == []


def test_train_with_the_vllm_backend_on_this_machine_exits_2_before_any_rank(tmp_path):
    result = run_cli("train", "examples/grpo/tiny_letter.yaml", "rollout_backend=vllm", f"output_dir={tmp_path}")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert len(lines) == 1 and "rollout_backend (vllm)" in lines[0], result.stderr
    assert not (tmp_path / "trainer_log.jsonl").exists() and "Traceback" not in result.stderr


def test_the_protocol_generator_takes_full_freeze_and_plain_lora_only():
    for allowed in ({"finetuning_type": "full"}, {"finetuning_type": "freeze"}, {"finetuning_type": "lora"}):
        assert grpo_problems(config(rollout_backend="vllm_protocol_cpu", **allowed)) == []
    for refused in ({"finetuning_type": "oft"}, {"finetuning_type": "lora", "use_dora": True}):
        problems = grpo_problems(config(rollout_backend="vllm_protocol_cpu", **refused))
        assert len(problems) == 1 and problems[0].startswith("rollout_backend (vllm_protocol_cpu) with"), problems


def test_the_protocol_generator_under_fsdp1_is_refused_before_launch(tmp_path):
    result = run_cli("check", "examples/grpo/tiny_letter.yaml", "rollout_backend=vllm_protocol_cpu",
                     "fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_version': 1}", f"output_dir={tmp_path}",
                     NPROC_PER_NODE="2")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert any("rollout_backend (vllm_protocol_cpu) with fsdp_version 1" in line for line in lines), result.stderr
