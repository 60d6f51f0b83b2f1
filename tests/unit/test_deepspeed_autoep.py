"""expert_parallel_size under DeepSpeed: the ``expert_parallel`` section (DeepSpeed's AutoEP) translated from our
key, and its refusals made before launch naming the ZeRO stage and the family (parity: tests/distributed/
test_expert_parallel.py, the ``z<stage>ep<E>`` cells)."""

from __future__ import annotations

import pytest

from shardtune.cli import main
from shardtune.engines.deepspeed_autoep import AUTOEP_PRESETS, autoep_problems, autoep_section, with_autoep
from tests.unit.test_preflight import write_config

KEY = "expert_parallel_size (2)"


def test_the_section_names_the_families_preset_and_matches_blocks_under_peft() -> None:
    import re

    section = autoep_section(2, "qwen2_moe")
    assert section == {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe",
                       "moe_layer_pattern": section["moe_layer_pattern"]}
    pattern = re.compile(section["moe_layer_pattern"])
    assert pattern.fullmatch("model.layers.3.mlp") and pattern.fullmatch("base_model.model.model.layers.0.mlp")
    assert not pattern.fullmatch("model.layers.3.mlp.experts")


def test_the_config_gains_the_section_only_with_expert_parallelism() -> None:
    config = {"zero_optimization": {"stage": 2}, "train_batch_size": 8}
    assert with_autoep(config, 1, None) is config
    split = with_autoep(config, 4, "deepseek_v3")
    assert split["expert_parallel"]["autoep_size"] == 4 and split["expert_parallel"]["preset_model"] == "deepseek_v3"
    assert "expert_parallel" not in config and split["zero_optimization"] == config["zero_optimization"]


@pytest.mark.parametrize(("stage", "family", "finetuning", "offloads", "named"), [
    (0, "qwen3_moe", "full", False, "(ZeRO stage 0) on qwen3_moe: DeepSpeed's ZeRO-0 clips with the average"),
    (2, "gpt_oss", "full", False, "(ZeRO stage 2) on gpt_oss: DeepSpeed's AutoEP is driven here for"),
    (1, "qwen3_moe", "lora", False, "and finetuning_type lora: with the experts frozen"),
    (2, "qwen3_moe", "full", True, "and offload: AutoEP with ZeRO offload was not run"),
], ids=["zero0", "family", "lora", "offload"])
def test_refusals_name_the_stage_and_the_family(stage, family, finetuning, offloads, named) -> None:
    problems = autoep_problems(KEY, stage, family, finetuning, offloads)
    assert len(problems) == 1 and named in problems[0] and problems[0].startswith(f"{KEY} with deepspeed")


def test_what_it_runs_passes() -> None:
    for stage in (1, 2, 3):
        for family in AUTOEP_PRESETS:
            assert autoep_problems(KEY, stage, family, "full") == []
    # the estimate asks without a family: its memory model splits experts under FSDP2 only
    assert "driven here for deepseek_v3, mixtral, qwen2_moe, qwen3_moe only" in autoep_problems(KEY, 2, "this model")[0]


def test_check_passes_zero2_and_zero3_and_refuses_offload_through_the_cli(arch_model_dir, tmp_path, capsys,
                                                                         monkeypatch) -> None:
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    monkeypatch.setenv("FORCE_TORCHRUN", "1")
    model = arch_model_dir("qwen3_moe")
    for config, code in (("ds_z2_config.json", 0), ("ds_z3_config.json", 0), ("ds_z2_offload_config.json", 2)):
        path = write_config(tmp_path, model, template="qwen3", finetuning_type="full", expert_parallel_size=2,
                            deepspeed=f"examples/deepspeed/{config}")
        assert main(["check", str(path)]) == code, (config, capsys.readouterr().err)
    assert "with deepspeed (ZeRO stage 2) on qwen3_moe and offload" in capsys.readouterr().err


def test_an_autoep_checkpoint_resumes_only_under_autoep_on_its_world(tmp_path) -> None:
    from shardtune.engines.deepspeed_autoep import autoep_resume_problems

    plain, split = tmp_path / "plain", tmp_path / "split"
    for folder, names in ((plain, ()), (split, ("layer_0_expert_0_mp_rank_00_model_states.pt",))):
        (folder / "deepspeed").mkdir(parents=True)
        for name in (*names, *(f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2))):
            (folder / "deepspeed" / name).touch()
    assert autoep_resume_problems(split, 2, 2) == [] and autoep_resume_problems(plain, 1, 2) == []
    assert "written with DeepSpeed's AutoEP" in autoep_resume_problems(split, 1, 2)[0]
    assert "written without expert parallelism" in autoep_resume_problems(plain, 2, 2)[0]
    assert "by 2 processes" in autoep_resume_problems(split, 2, 4)[0]
    assert autoep_resume_problems(None, 2, 2) == [] and autoep_resume_problems(tmp_path / "none", 2, 2) == []


def test_a_zero3_autoep_checkpoint_is_known_by_its_config(tmp_path) -> None:
    """ZeRO-3 keeps AutoEP's experts inside its shards (no per-expert files): the checkpoint's copy of the run's
    config says it was split, and over how many ranks."""
    import json

    from shardtune.engines.deepspeed_autoep import autoep_resume_problems

    folder = tmp_path / "checkpoint-2"
    (folder / "deepspeed").mkdir(parents=True)
    for rank in range(2):
        (folder / "deepspeed" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").touch()
    (folder / "shardtune_config.json").write_text(json.dumps({"expert_parallel_size": 2}))
    assert autoep_resume_problems(folder, 2, 2) == []
    assert "written with DeepSpeed's AutoEP" in autoep_resume_problems(folder, 1, 2)[0]
    assert "resume with expert_parallel_size: 2" in autoep_resume_problems(folder, 4, 2)[0]


def test_export_of_an_autoep_checkpoint_is_refused_by_name(tmp_path) -> None:
    from shardtune.engines.deepspeed_config import read_zero_checkpoint
    from shardtune.errors import ModelError

    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "layer_0_expert_1_mp_rank_00_model_states.pt").touch()
    with pytest.raises(ModelError, match="written with DeepSpeed's AutoEP"):
        read_zero_checkpoint(None, tmp_path)
