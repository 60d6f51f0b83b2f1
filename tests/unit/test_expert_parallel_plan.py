"""expert_parallel_size's refusals, made on the launching host before any rank starts (``check`` as ``train``):
every engine, strategy, feature and model it cannot combine with gets one line naming the key, the reason and the
fix. The families are transformers' own: every MoE model type of the installed transformers either has the fused
experts interface the dispatch drives or is refused by name."""

from __future__ import annotations

import pytest

from shardtune.cli import main
from shardtune.model.moe import experts_classes, routing_interface_problem
from shardtune.world import WorldLayout
from tests.unit.test_preflight import write_config

FSDP2 = {"fsdp": "full_shard"}


@pytest.mark.parametrize(("values", "nproc", "named"), [
    ({}, 2, "expert_parallel_size (2) with engine ddp: expert parallelism places each expert on some ranks only"),
    ({}, 1, "expert_parallel_size (2) with engine local"),
    ({"deepspeed": "examples/deepspeed/ds_z0_config.json"}, 2,
     "expert_parallel_size (2) with deepspeed (ZeRO stage 0) on qwen3_moe"),
    ({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 1}}, 2, "with fsdp_version: 1"),
    ({"fsdp": "hybrid_shard"}, 4, "with sharding_strategy HYBRID_SHARD"),
    ({"fsdp": "full_shard offload"}, 2, "with offload_params"),
    ({**FSDP2, "expert_parallel_size": 3}, 2, "expert_parallel_size (3) does not divide the world size (2)"),
    ({**FSDP2, "expert_parallel_size": 8}, 8, "does not divide the model's 4 experts per layer"),
    ({**FSDP2, "quantization_bit": 4, "finetuning_type": "lora", "lora_target": "q_proj"}, 2,
     "with quantization_bit (4)"),
], ids=["ddp", "local", "deepspeed", "fsdp1", "hybrid", "offload", "world", "experts", "qlora"])
def test_refused_before_launch(arch_model_dir, tmp_path, capsys, monkeypatch, values, nproc, named) -> None:
    monkeypatch.setenv("NPROC_PER_NODE", str(nproc))
    monkeypatch.setenv("FORCE_TORCHRUN", "1")
    values = {"finetuning_type": "full", "expert_parallel_size": 2, **values}
    path = write_config(tmp_path, arch_model_dir("qwen3_moe"), template="qwen3", **values)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


def test_a_dense_model_is_refused_by_name(tiny_model_dir, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    path = write_config(tmp_path, tiny_model_dir, finetuning_type="full", expert_parallel_size=2, **FSDP2)
    assert main(["check", str(path)]) == 2
    assert "has no mixture-of-experts layers" in capsys.readouterr().err


def test_what_it_is_built_for_passes(arch_model_dir, tmp_path, monkeypatch) -> None:
    """FSDP2 full, SHARD_GRAD_OP, LoRA beside the experts and LoRA on them too, with sequence parallelism, on 2 and
    4 ranks."""
    model = arch_model_dir("qwen3_moe")
    for nproc, values in ((2, {"finetuning_type": "full", **FSDP2}),
                          (4, {"finetuning_type": "full", "fsdp": "shard_grad_op"}),
                          (4, {"finetuning_type": "lora", "lora_target": "q_proj,v_proj,o_proj", **FSDP2,
                               "expert_parallel_size": 4}),
                          (2, {"finetuning_type": "lora", "lora_target": "all", **FSDP2}),
                          (4, {"finetuning_type": "full", **FSDP2, "sequence_parallel_size": 2,
                               "moe_aux_loss_coef": 0})):
        monkeypatch.setenv("NPROC_PER_NODE", str(nproc))
        path = write_config(tmp_path, model, template="qwen3", **{"expert_parallel_size": 2, **values})
        assert main(["check", str(path)]) == 0, values


def test_every_moe_family_of_transformers_is_driven_or_refused() -> None:
    """From transformers' registry: each fused-experts class takes the routing choices (the dispatch drives it) or
    gets the one-line refusal (Llama 4 routes before its experts)."""
    from transformers import CONFIG_MAPPING

    classes = {cls for model_type in CONFIG_MAPPING for cls in experts_classes(model_type)}
    assert len(classes) > 20
    refused = sorted(cls.__name__ for cls in classes if routing_interface_problem(cls))
    assert "Llama4TextExperts" in refused
    assert {"Qwen3MoeExperts", "MixtralExperts", "DeepseekV3Experts", "GptOssExperts"}.isdisjoint(refused)
    for name in refused:
        assert "set expert_parallel_size: 1" in routing_interface_problem(
            next(c for c in classes if c.__name__ == name))


def test_world_arithmetic_names_every_number() -> None:
    layout = WorldLayout(2, 4, expert_parallel=4)
    assert layout.expert_parallel_problems(8) == [] and layout.expert_data_parallel_size == 2
    assert WorldLayout(1, 6, expert_parallel=4).expert_parallel_problems(8) == [
        "expert_parallel_size (4) does not divide the world size (6); use a divisor of it or 8 processes"]
    assert "does not divide the model's 6 experts" in WorldLayout(1, 4, expert_parallel=4).expert_parallel_problems(
        6)[0]


def test_a_home_of_no_known_user_is_a_path_as_written(tmp_path, capsys) -> None:
    """The fuzzer's find: `~0` (no user 0) made pathlib raise RuntimeError inside check; it is a path that does not
    exist, reported as such (paths.home_expanded, as the shell expands it)."""
    from shardtune.paths import home_expanded

    assert str(home_expanded("~0/model")) == "~0/model"
    path = write_config(tmp_path, tmp_path / "unused", model_name_or_path="~0", stage="rm", dataset="demo_dpo")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "model_name_or_path" in err, err
