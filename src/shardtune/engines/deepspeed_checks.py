"""DeepSpeed JSON checked against the training keys before any rank starts, one line per problem: unknown and
removed keys, "auto" where shardtune has no value, batch sizes, clipping and precision that contradict the
training keys, ZeRO stages and offloads that cannot go together, optimizers ZeRO cannot offload or never tested,
and reductions shardtune does its own way. ``build_deepspeed_config`` loads, checks and resolves in one call.
Pure functions, as deepspeed_config.py (which loads and resolves).
"""

from __future__ import annotations

import difflib
from typing import Any

from shardtune.engines.deepspeed_config import (
    ADAM_OPTIMS,
    AUTO,
    CPU_OFFLOAD_OPTIMIZER_TYPES,
    DEEPSPEED_NATIVE_AUTO,
    DEEPSPEED_TOP_LEVEL_KEYS,
    IGNORED_FOREIGN_KEYS,
    REMOVED_TOP_LEVEL_KEYS,
    SEQUENCE_PARALLEL_KEY,
    DeepSpeedInputs,
    auto_values,
    get_path,
    has_own_optimizer,
    load_deepspeed_setting,
    offloads_optimizer,
    offloads_params,
    precision_section,
    resolve_deepspeed_config,
    show_json,
    walk_auto,
    zero_section,
    zero_stage,
)
from shardtune.errors import ConfigError


def deepspeed_problems(raw: dict, inputs: DeepSpeedInputs, source: str) -> list[str]:
    """Every reason this config cannot train as the training keys say, one line each (empty when fine)."""
    return [
        *_key_problems(raw, source),
        *_auto_problems(raw, inputs, source),
        *_batch_problems(raw, inputs, source),
        *_precision_problems(raw, inputs, source),
        *_zero_problems(raw, source),
        *_optimizer_problems(raw, inputs, source),
        *_reduction_problems(raw, source),
    ]


def _key_problems(raw: dict, source: str) -> list[str]:
    problems = []
    for key in raw:
        if key in DEEPSPEED_TOP_LEVEL_KEYS or key in IGNORED_FOREIGN_KEYS:
            continue
        if key in REMOVED_TOP_LEVEL_KEYS:
            problems.append(f"{key} in {source}: DeepSpeed 0.19.8 removed this feature and refuses the key; "
                            "delete it")
            continue
        close = difflib.get_close_matches(key, sorted(DEEPSPEED_TOP_LEVEL_KEYS), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        problems.append(f"{key} in {source}: not a DeepSpeed 0.19.8 key (DeepSpeed would ignore it){hint}")
    if "zero_optimization" in raw and not isinstance(raw["zero_optimization"], dict):
        problems.append(f"zero_optimization in {source}: must be a mapping, got {show_json(raw['zero_optimization'])}")
    return problems


def _auto_problems(raw: dict, inputs: DeepSpeedInputs, source: str) -> list[str]:
    resolvable = auto_values(inputs)
    problems = []
    for path in walk_auto(raw):
        dotted = ".".join(path)
        if path == ("scheduler", "params", "total_num_steps") and inputs.total_steps is None:
            problems.append(f"{dotted} in {source}: \"auto\" needs the number of training steps, "
                            "which is not known here; set it explicitly")
        elif path not in resolvable and path not in DEEPSPEED_NATIVE_AUTO and path != (SEQUENCE_PARALLEL_KEY,):
            problems.append(f"{dotted} in {source}: shardtune has no value for \"auto\" here; set it explicitly")
    return problems


def _explicit(raw: dict, path: tuple[str, ...]) -> Any:
    """The value at ``path`` unless missing or "auto" (then None)."""
    value = get_path(raw, path)
    return None if value == AUTO else value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _batch_problems(raw: dict, inputs: DeepSpeedInputs, source: str) -> list[str]:
    pairs = (
        ("train_micro_batch_size_per_gpu", inputs.layout.micro_batch,
         f"per_device_train_batch_size ({inputs.layout.micro_batch})"),
        ("gradient_accumulation_steps", inputs.layout.grad_accum,
         f"gradient_accumulation_steps ({inputs.layout.grad_accum})"),
        ("train_batch_size", inputs.train_batch_size,
         f"per_device_train_batch_size ({inputs.layout.micro_batch}) x gradient_accumulation_steps "
         f"({inputs.layout.grad_accum}) x world size ({inputs.layout.world_size}) = {inputs.train_batch_size}"),
        ("gradient_clipping", inputs.max_grad_norm, f"max_grad_norm ({show_json(inputs.max_grad_norm)})"),
    )
    problems = []
    for key, expected, ours in pairs:
        value = _explicit(raw, (key,))
        if value is None:
            continue
        if not _is_number(value):
            problems.append(f"{key} in {source}: must be a number or \"auto\", got {show_json(value)}")
        elif float(value) != float(expected):
            problems.append(f"{key} ({show_json(value)}) in {source} contradicts {ours}; use \"auto\" or the same "
                            "value")
    return problems


def _precision_problems(raw: dict, inputs: DeepSpeedInputs, source: str) -> list[str]:
    problems = []
    enabled = {}
    for name, ours in (("fp16", inputs.fp16), ("bf16", inputs.bf16)):
        if name in raw and not isinstance(raw[name], dict):
            problems.append(f"{name} in {source}: must be a mapping such as {{\"enabled\": \"auto\"}}, "
                            f"got {show_json(raw[name])}")
            enabled[name] = ours
            continue
        value = precision_section(raw, name).get("enabled")
        if value is None or value == AUTO:
            enabled[name] = ours
            continue
        enabled[name] = value
        if not isinstance(value, bool):
            problems.append(f"{name}.enabled in {source}: must be true, false or \"auto\", got {show_json(value)}")
        elif value != ours:
            problems.append(f"{name}.enabled ({show_json(value)}) in {source} contradicts {name} ({show_json(ours)}); "
                            f"use \"auto\" or the same value")
    if enabled["fp16"] is True and enabled["bf16"] is True:
        problems.append(f"fp16 and bf16 are both enabled (in {source} or the training keys); choose one")
    return problems


def _zero_problems(raw: dict, source: str) -> list[str]:
    zero = zero_section(raw)
    stage = zero.get("stage", 0)
    if not _is_number(stage) or stage not in (0, 1, 2, 3):
        return [f"zero_optimization.stage ({show_json(stage)}) in {source}: must be 0, 1, 2 or 3"]
    problems = []
    if offloads_params(raw) and stage != 3:
        problems.append(f"zero_optimization.offload_param in {source} needs stage 3, but stage is {stage}; "
                        "remove offload_param or use stage 3")
    if offloads_optimizer(raw) and stage == 0:
        problems.append(f"zero_optimization.offload_optimizer in {source} needs stage 1, 2 or 3, but stage is 0")
    return problems


def _optimizer_problems(raw: dict, inputs: DeepSpeedInputs, source: str) -> list[str]:
    offload = offloads_optimizer(raw)
    if has_own_optimizer(raw):
        kind = str(raw["optimizer"].get("type", ""))
        if offload and kind.lower() not in CPU_OFFLOAD_OPTIMIZER_TYPES:
            return [f"optimizer.type ({show_json(kind)}) in {source} has no CPU implementation for "
                    "zero_optimization.offload_optimizer; use AdamW, Adam, Adagrad or Lion, or drop the offload"]
        return []
    problems = []
    optim = inputs.optimizer.optim
    if offload and optim not in ADAM_OPTIMS and raw.get("zero_force_ds_cpu_optimizer", True) is not False:
        problems.append(f"zero_optimization.offload_optimizer in {source} runs DeepSpeedCPUAdam, which optim "
                        f"({optim}) cannot become; use optim adamw_torch, or set "
                        "\"zero_force_ds_cpu_optimizer\": false to step it on the CPU as is")
    if zero_stage(raw) > 0 and optim not in ADAM_OPTIMS and raw.get("zero_allow_untested_optimizer") is not True:
        problems.append(f"optim ({optim}) is not one DeepSpeed ZeRO tested; set "
                        f"\"zero_allow_untested_optimizer\": true in {source} or use optim adamw_torch")
    return problems


def _reduction_problems(raw: dict, source: str) -> list[str]:
    problems = []
    op = raw.get("gradient_allreduce_op", "mean")
    if op not in ("mean", "sum"):
        problems.append(f"gradient_allreduce_op ({show_json(op)}) in {source}: must be \"mean\" or \"sum\"")
    elif op == "sum" and zero_stage(raw) == 3:
        problems.append(f"gradient_allreduce_op (\"sum\") in {source}: DeepSpeed does not support it with stage 3")
    if raw.get("managed_gradient_accumulation", True) is not True:
        value = show_json(raw["managed_gradient_accumulation"])
        problems.append(f"managed_gradient_accumulation ({value}) in {source}: shardtune marks accumulation "
                        "boundaries itself; remove the key")
    return problems


def build_deepspeed_config(value: str | dict, inputs: DeepSpeedInputs) -> dict:
    """Load, check and resolve in one call; all problems are raised together as one ConfigError."""
    raw, source = load_deepspeed_setting(value)
    problems = deepspeed_problems(raw, inputs, source)
    if problems:
        raise ConfigError(*problems)
    return resolve_deepspeed_config(raw, inputs)
