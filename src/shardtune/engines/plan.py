"""Which engine a run uses and with what settings, decided on the launching host (pure)."""

from __future__ import annotations

from typing import Any

from shardtune.config.schema import TrainConfig
from shardtune.engines import deepspeed_config, fsdp_config, replicated
from shardtune.engines.engine_plan import EnginePlan
from shardtune.engines.fsdp_config import (
    fsdp1_qlora_problems,
    fsdp_async_save_problems,
    is_fsdp_requested,
    resolve_fsdp_settings,
)
from shardtune.engines.spec import EngineSpec
from shardtune.model.folder import pre_quantized_method

# Every engine's record (engines/spec.py); a new engine is a module with its record, and a line here.
ENGINE_SPECS: dict[str, EngineSpec] = {spec.kind: spec for spec in (
    replicated.LOCAL, replicated.DDP, fsdp_config.FSDP, deepspeed_config.DEEPSPEED)}
ENGINE_KINDS = tuple(ENGINE_SPECS)


def spec_for(kind: str) -> EngineSpec:
    return ENGINE_SPECS[kind]


def plan_engine(c: TrainConfig, world_size: int, has_cuda: bool) -> tuple[EnginePlan, list[str]]:
    """Pick DeepSpeed / FSDP when configured, DDP for several processes, else local; list every problem: the
    engine's own refusals (its record) and the rules every engine shares."""
    plan, problems = _choose_engine(c, world_size)
    return plan, problems + spec_for(plan.kind).refusals(c, plan, has_cuda) + quantization_problems(c, has_cuda)


def _choose_engine(c: TrainConfig, world_size: int) -> tuple[EnginePlan, list[str]]:
    wants_fsdp = is_fsdp_requested(c.fsdp, c.fsdp_config)
    if c.deepspeed and wants_fsdp:
        return EnginePlan("local"), [f"deepspeed ({_short(c.deepspeed)}) and fsdp ({_short(c.fsdp or c.fsdp_config)})"
                                     " are both set; choose one engine"]
    if c.deepspeed:
        return _plan_deepspeed(c.deepspeed)
    if wants_fsdp:
        return _plan_fsdp(c, world_size)
    return EnginePlan("ddp" if world_size > 1 else "local"), []


def _plan_deepspeed(setting: str | dict[str, Any]) -> tuple[EnginePlan, list[str]]:
    from shardtune.engines.deepspeed_config import load_deepspeed_setting
    from shardtune.errors import ConfigError

    try:
        raw, source = load_deepspeed_setting(setting)
    except ConfigError as err:
        return EnginePlan("deepspeed"), err.problems
    return EnginePlan("deepspeed", deepspeed_raw=raw, deepspeed_source=source), []


def _plan_fsdp(c: TrainConfig, world_size: int) -> tuple[EnginePlan, list[str]]:
    fsdp_config = c.fsdp_config
    problems: list[str] = []
    if isinstance(fsdp_config, str):
        fsdp_config, problems = _load_fsdp_config_file(fsdp_config, world_size)
    settings, more = resolve_fsdp_settings(c.fsdp, fsdp_config)
    return EnginePlan("fsdp", fsdp=settings), problems + more + fsdp1_qlora_problems(c, settings, world_size) + \
        fsdp_async_save_problems(c.async_save, settings)


def _load_fsdp_config_file(path: str, world_size: int) -> tuple[dict[str, Any], list[str]]:
    """An FSDP settings file, or an accelerate config file whose `fsdp_config` section is used."""
    from pathlib import Path

    from shardtune.config.load import load_yaml_file
    from shardtune.errors import ConfigError

    if Path(path).is_dir():
        return {}, [f"fsdp_config: {path} is a folder; give the FSDP or accelerate config file"]
    if not Path(path).is_file():
        return {}, [f"fsdp_config: file not found: {path}"]
    try:
        data = load_yaml_file(path)
    except ConfigError as err:
        return {}, [f"fsdp_config: {problem}" for problem in err.problems]
    if "distributed_type" not in data:
        return data, []
    section = dict(data.get("fsdp_config") or {})
    section.setdefault("fsdp_version", 1)  # accelerate's default when the file names no version
    return section, accelerate_file_problems(path, data, world_size)


def accelerate_file_problems(path: str, data: dict[str, Any], world_size: int) -> list[str]:
    """An accelerate config must describe the launch that actually happens (else ranks wait for peers)."""
    problems = []
    if data.get("distributed_type") != "FSDP":
        problems.append(f"fsdp_config: {path} is an accelerate config with distributed_type "
                        f"{data.get('distributed_type')}, not FSDP")
    expected = data.get("num_processes")
    if expected is not None and int(expected) != world_size:
        problems.append(f"fsdp_config: {path} says num_processes: {expected} but this launch has {world_size} "
                        "processes (NNODES x NPROC_PER_NODE); make them agree")
    return problems


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) < 40 else text[:37] + "..."


def quantization_problems(c: TrainConfig, has_cuda: bool) -> list[str]:
    """QLoRA rules of every engine: bitsandbytes on CUDA, never on an already quantized model (what FSDP and
    ZeRO-3 cannot shard is in their records)."""
    problems = []
    if c.ref_model_quantization_bit is not None and not has_cuda:
        problems.append(f"ref_model_quantization_bit ({c.ref_model_quantization_bit}) loads ref_model through "
                        "bitsandbytes, which needs a CUDA GPU; none is visible here. Remove it to keep ref_model in "
                        "full precision.")
    if c.quantization_bit is None:
        return problems
    method = pre_quantized_method(c.model_name_or_path)
    if method:
        problems.append(f"quantization_bit ({c.quantization_bit}): the model is already quantized ({method}); "
                        "remove quantization_bit")
    if not has_cuda:
        problems.append(f"quantization_bit ({c.quantization_bit}) needs a CUDA GPU and bitsandbytes; none is "
                        "visible here. Remove quantization_bit to train in full precision.")
    return problems
