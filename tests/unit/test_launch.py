"""Launch planning: environment contract, torchrun argv (pure), accelerate mapping, FSDP settings."""

from __future__ import annotations

import pytest

from shardtune.engines.engine_plan import FsdpSettings
from shardtune.engines.fsdp_config import (
    STRATEGIES,
    fsdp1_strategy_member,
    reshards_after_forward,
    resolve_fsdp_settings,
)
from shardtune.errors import ConfigError
from shardtune.launch.accelerate import config_values_from_accelerate
from shardtune.launch.env import read_launch_env
from shardtune.launch.torchrun import build_torchrun_argv, plan_launch, worker_argv
from shardtune.world import WorldLayout

PY = "/usr/bin/python3"


def test_defaults_one_process_on_cpu():
    plan = plan_launch(read_launch_env({}), visible_gpus=0, free_port=1234)
    assert (plan.nnodes, plan.nproc_per_node, plan.world_size, plan.master_port) == (1, 1, 1, 1234)


def test_nproc_defaults_to_visible_gpus():
    assert plan_launch(read_launch_env({}), visible_gpus=4, free_port=1).nproc_per_node == 4


def test_static_multi_node_argv():
    env = read_launch_env({"NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "2", "MASTER_ADDR": "10.0.0.1",
                           "MASTER_PORT": "29500"})
    plan = plan_launch(env, visible_gpus=0)
    argv = build_torchrun_argv(plan, plan.node_rank, worker_argv("out dir/cfg.json"), PY)
    assert argv == [PY, "-m", "shardtune.launch.torchrun_agent", "--nproc-per-node=2", "--nnodes=2", "--node-rank=1",
                    "--master-addr=10.0.0.1", "--master-port=29500", "-m", "shardtune.train", "out dir/cfg.json"]
    assert plan.world_size == 4


def test_elastic_argv():
    env = read_launch_env({"NNODES": "2", "MIN_NNODES": "1", "MAX_NNODES": "2", "MAX_RESTARTS": "3",
                           "RDZV_ID": "job7", "MASTER_PORT": "29400", "MASTER_ADDR": "127.0.0.1"})
    plan = plan_launch(env, visible_gpus=0)
    argv = build_torchrun_argv(plan, 0, worker_argv("c.json"), PY)
    assert "--nnodes=1:2" in argv and "--rdzv-backend=c10d" in argv and "--max-restarts=3" in argv
    assert "--rdzv-endpoint=127.0.0.1:29400" in argv and "--rdzv-id=job7" in argv


@pytest.mark.parametrize(("env", "fragment"), [
    ({"NNODES": "2"}, "MASTER_PORT must be set when NNODES=2"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_PORT": "1"}, "NODE_RANK=2 must be in 0..1"),
    ({"NPROC_PER_NODE": "two"}, "NPROC_PER_NODE='two' is not an integer"),
])
def test_bad_launch_environment(env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        plan_launch(read_launch_env(env), visible_gpus=0)


def test_accelerate_fsdp2_variables():
    values = config_values_from_accelerate({
        "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_OFFLOAD_PARAMS": "true", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_SHARDING_STRATEGY": "None", "ACCELERATE_MIXED_PRECISION": "bf16"})
    settings, problems = resolve_fsdp_settings(None, values["fsdp_config"])
    assert problems == [] and values["bf16"] is True
    assert settings == FsdpSettings(version=2, sharding_strategy="SHARD_GRAD_OP", offload_params=True,
                                    transformer_layer_cls_to_wrap=("LlamaDecoderLayer",))


def test_accelerate_fsdp1_numbered_strategy():
    values = config_values_from_accelerate({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1",
                                            "FSDP_SHARDING_STRATEGY": "2"})
    settings, problems = resolve_fsdp_settings(None, values["fsdp_config"])
    assert problems == [] and settings.version == 1 and settings.sharding_strategy == "SHARD_GRAD_OP"


def test_accelerate_deepspeed_variables():
    values = config_values_from_accelerate({"ACCELERATE_USE_DEEPSPEED": "true",
                                            "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                                            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
                                            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none"})
    zero = values["deepspeed"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu"} and "offload_param" not in zero
    assert config_values_from_accelerate({}) == {}


def test_fsdp_words_and_config_keys():
    settings, problems = resolve_fsdp_settings("hybrid_shard offload auto_wrap",
                                               {"fsdp_version": 1, "fsdp_state_dict_type": "FULL_STATE_DICT",
                                                "fsdp_min_num_params": 1000, "hsdp_shard_size": 2})
    assert problems == []
    assert (settings.sharding_strategy, settings.offload_params, settings.version, settings.state_dict_type) == \
        ("HYBRID_SHARD", True, 1, "FULL_STATE_DICT")


def test_fsdp_unknown_option_and_key():
    _, problems = resolve_fsdp_settings("full_shard fast", {"fsdp_sharding_stratgy": "FULL_SHARD",
                                                            "fsdp_state_dict_type": "PARTIAL"})
    joined = "\n".join(problems)
    assert "fsdp: unknown option 'fast'" in joined
    assert "unknown key 'fsdp_sharding_stratgy' (did you mean 'fsdp_sharding_strategy'?)" in joined
    assert "fsdp_state_dict_type: 'PARTIAL' is not allowed" in joined


def test_hybrid_mesh_never_silently_degrades():
    hybrid = FsdpSettings(sharding_strategy="HYBRID_SHARD")
    assert WorldLayout(2, 2).hybrid_groups("HYBRID_SHARD", hybrid.hsdp_shard_size) == (2, 2)
    with pytest.raises(ValueError, match="one replica"):
        WorldLayout(1, 2).hybrid_groups("HYBRID_SHARD", hybrid.hsdp_shard_size)
    with pytest.raises(ValueError, match="at least 2 processes per shard group"):
        WorldLayout(2, 1).hybrid_groups("HYBRID_SHARD", hybrid.hsdp_shard_size)
    assert WorldLayout(1, 4).hybrid_groups("HYBRID_SHARD", 2) == (2, 2)


def test_rendezvous_timeout_bounds_the_wait():
    env = read_launch_env({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                           "RDZV_TIMEOUT": "30"})
    argv = build_torchrun_argv(plan_launch(env, visible_gpus=0), 0, worker_argv("c.json"), PY)
    assert "--rdzv-conf=join_timeout=30,timeout=30" in argv


def test_every_strategy_maps_onto_fsdp1_and_fsdp2():
    from torch.distributed.fsdp import ShardingStrategy

    for strategy in STRATEGIES:
        assert ShardingStrategy[fsdp1_strategy_member(strategy)]  # HYBRID_SHARD_ZERO2 is private in torch
    assert ShardingStrategy[fsdp1_strategy_member("HYBRID_SHARD_ZERO2")] is ShardingStrategy._HYBRID_SHARD_ZERO2
    assert [s for s in STRATEGIES if reshards_after_forward(s)] == ["FULL_SHARD", "HYBRID_SHARD"]


def test_an_uneven_placement_is_a_layout_not_an_error():
    """Ray put 8 workers on one 8-GPU node and 4 on another: every rank gets the same data-parallel world."""
    for local in (8, 4):
        layout = WorldLayout.of_ranks(12, local, micro_batch=2, grad_accum=3)
        assert (layout.world_size, layout.data_parallel_size, layout.global_batch) == (12, 12, 72)
    placed = WorldLayout.of_placement([8] * 8 + [4] * 4)
    assert (placed.world_size, placed.nodes, placed.uneven_ranks) == (12, 2, 12)
    assert WorldLayout.of_placement([4] * 8) == WorldLayout(2, 4)  # even: the plain layout
    # Node-shaped groups need even nodes; an explicit shard size does not.
    with pytest.raises(ValueError, match="12 ranks are spread unevenly over its nodes"):
        placed.hybrid_groups("HYBRID_SHARD", None)
    assert placed.hybrid_groups("HYBRID_SHARD", 4) == (3, 4)
