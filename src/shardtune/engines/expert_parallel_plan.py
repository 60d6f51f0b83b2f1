"""What expert parallelism (``expert_parallel_size`` E > 1) needs, decided on the launching host before any rank
starts: the engine, the model and the features it is built for, and the dry run's line. Pure: it reads config.json
files, never torch (the dispatch itself is engines/expert_parallel.py, which runs on the ranks).

Exact and proven (tests/distributed/test_expert_parallel.py): FSDP2 (FULL_SHARD, SHARD_GRAD_OP), full fine-tuning,
freeze, and LoRA (on attention, dense and shared-expert MLPs, and the fused expert weights: each rank applies its
experts' slice of the adapters, engines/expert_adapters.py), every MoE family with
transformers' fused experts; DeepSpeed ZeRO-1/2 through its AutoEP for the families deepspeed_autoep.py lists, full
fine-tuning; either with sequence parallelism (tests/distributed/test_expert_sequence_parallel.py). Everything else
is refused here, with the reason.
"""

from __future__ import annotations

from typing import Any

from shardtune.config.schema import TrainConfig
from shardtune.engines.deepspeed_autoep import autoep_problems
from shardtune.engines.deepspeed_config import offloads_optimizer, offloads_params, zero_stage
from shardtune.engines.engine_plan import EnginePlan
from shardtune.errors import ModelError
from shardtune.model.folder import model_config_json
from shardtune.model.moe import expert_count, experts_classes, routing_interface_problem
from shardtune.world import WorldLayout

FIX = "set expert_parallel_size: 1"
SHARDING_ENGINE = "use FSDP2 (fsdp: full_shard, fsdp_version: 2)"


def expert_parallel_problems(c: TrainConfig, engine: EnginePlan | None = None,
                             layout: WorldLayout | None = None) -> list[str]:
    """Why this run cannot split its experts over ``c.expert_parallel_size`` ranks, one line each naming the key and
    the fix (empty with E = 1). ``engine``/``layout``: None while they are unknown (a bad launch variable)."""
    n = c.expert_parallel_size
    if n == 1:
        return []
    key = f"expert_parallel_size ({n})"
    problems = feature_problems(c, key) + model_problems(c, key)
    if engine is not None:
        family = str((_config(c) or {}).get("model_type", "this model"))
        problems += engine_problems(engine, key, family, c.finetuning_type)
    if layout is not None:
        problems += layout.expert_parallel_problems(_experts(c))
    return problems


def engine_problems(engine: EnginePlan, key: str, family: str = "this model",
                    finetuning_type: str | None = None) -> list[str]:
    """The engine's refusals (``finetuning_type``: None where unknown, the estimate's question)."""
    if engine.kind in ("local", "ddp"):
        return [f"{key} with engine {engine.kind}: expert parallelism places each expert on some ranks only, which "
                f"needs a sharding engine; {SHARDING_ENGINE}, or {FIX}"]
    if engine.kind == "deepspeed":
        raw = engine.deepspeed_raw or {}
        return autoep_problems(key, zero_stage(raw), family, finetuning_type,
                               offloads=offloads_optimizer(raw) or offloads_params(raw))
    s = engine.fsdp
    if s is None:
        return []
    if s.version == 1:
        return [f"{key} with fsdp_version: 1: FSDP1 flattens every weight of a unit into one buffer and cannot hold "
                f"a layer's experts on some ranks only; set fsdp_version: 2, or {FIX}"]
    if s.is_hybrid or s.sharding_strategy == "NO_SHARD":
        return [f"{key} with sharding_strategy {s.sharding_strategy}: the experts are sharded over the ranks that "
                "hold the same experts, the dense weights over all ranks; replicated groups are not built for it "
                f"yet; use FULL_SHARD or SHARD_GRAD_OP, or {FIX}"]
    if s.offload_params:
        return [f"{key} with offload_params: the experts' dispatch runs on the device with their local weights; "
                f"set offload_params: false, or {FIX}"]
    return []


def feature_problems(c: TrainConfig, key: str) -> list[str]:
    problems = []  # with sequence_parallel_size: exact (engines/sequence_parallel_plan.py's COMBINATIONS)
    if c.quantization_bit is not None:
        problems.append(f"{key} with quantization_bit ({c.quantization_bit}): 4-/8-bit expert weights cannot be "
                        f"split as DTensors; train without quantization, or {FIX}")
    return problems


def model_problems(c: TrainConfig, key: str) -> list[str]:
    config = _config(c)
    if config is None:
        return []  # a hub id not downloaded yet, or a folder the file checks report
    if not expert_count(config):
        return [f"{key}: {c.model_name_or_path} has no mixture-of-experts layers (no num_experts, "
                f"num_local_experts or n_routed_experts in its config.json); {FIX}"]
    model_type = str(config.get("model_type", ""))
    problems = [p for cls in experts_classes(model_type) if (p := routing_interface_problem(cls))]
    if problems:
        return problems[:1]
    return []


def describe_expert_parallel(c: TrainConfig, layout: WorldLayout) -> str | None:
    """The dry run's line: the mesh and how many experts each rank holds."""
    n = layout.expert_parallel
    if n == 1:
        return None
    experts = _experts(c)
    held = f", {experts // n} of {experts} experts per layer on each rank" if experts else ""
    return (f"expert parallel: mesh (expert-data-parallel {layout.expert_data_parallel_size} x expert-parallel "
            f"{n}){held}; dense weights sharded over all {layout.world_size} ranks")


def _config(c: TrainConfig) -> dict[str, Any] | None:
    try:
        return model_config_json(c.model_name_or_path)
    except ModelError:
        return None


def _experts(c: TrainConfig) -> int | None:
    config = _config(c)
    return expert_count(config) or None if config else None
