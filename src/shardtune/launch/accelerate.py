"""Map what `accelerate launch --config_file F` hands its workers onto shardtune's own config keys (pure).

accelerate passes its config as environment variables (ACCELERATE_USE_FSDP, FSDP_*, ACCELERATE_USE_DEEPSPEED,
ACCELERATE_DEEPSPEED_*, ACCELERATE_MIXED_PRECISION); shardtune drives the engines itself with the same settings,
so the accelerate config files users already have work unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# FSDP_* variable -> fsdp_config key
_FSDP_KEYS = {
    "FSDP_VERSION": "fsdp_version",
    "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params",
    "FSDP_AUTO_WRAP_POLICY": "fsdp_auto_wrap_policy",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap",
    "FSDP_MIN_NUM_PARAMS": "fsdp_min_num_params",
    "FSDP_STATE_DICT_TYPE": "fsdp_state_dict_type",
    "FSDP_BACKWARD_PREFETCH": "fsdp_backward_prefetch",
    "FSDP_FORWARD_PREFETCH": "fsdp_forward_prefetch",
    "FSDP_USE_ORIG_PARAMS": "fsdp_use_orig_params",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "fsdp_cpu_ram_efficient_loading",
    "FSDP_SYNC_MODULE_STATES": "fsdp_sync_module_states",
}


def _is_true(value: str | None) -> bool:
    return str(value).lower() in ("true", "1", "yes")


def _is_set(value: str | None) -> bool:
    return value is not None and value not in ("", "None", "none")


def config_values_from_accelerate(env: Mapping[str, str]) -> dict[str, Any]:
    """Config keys implied by accelerate's worker environment (empty when not launched by accelerate)."""
    values: dict[str, Any] = {}
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision in ("bf16", "fp16"):
        values[precision] = True
    if _is_true(env.get("ACCELERATE_USE_FSDP")):
        values["fsdp_config"] = fsdp_config_from_env(env)
    elif _is_true(env.get("ACCELERATE_USE_DEEPSPEED")):
        values["deepspeed"] = deepspeed_from_env(env)
    return values


def fsdp_config_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    config = {key: env[var] for var, key in _FSDP_KEYS.items() if _is_set(env.get(var))}
    version = int(env.get("FSDP_VERSION", "1") or 1)
    if version == 2 and _is_set(env.get("FSDP_RESHARD_AFTER_FORWARD")):
        config["fsdp_reshard_after_forward"] = env["FSDP_RESHARD_AFTER_FORWARD"]
    elif _is_set(env.get("FSDP_SHARDING_STRATEGY")):
        config["fsdp_sharding_strategy"] = env["FSDP_SHARDING_STRATEGY"]
    return config


def deepspeed_from_env(env: Mapping[str, str]) -> str | dict[str, Any]:
    """The DeepSpeed config file accelerate names, or one built from its zero_stage / offload settings."""
    if _is_set(env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")):
        return env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
    stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2") or 2)
    zero: dict[str, Any] = {"stage": stage}
    for kind in ("optimizer", "param"):
        device = env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind.upper()}_DEVICE", "none")
        if device not in ("none", "", "None"):
            zero[f"offload_{kind}"] = {"device": device}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = _is_true(
            env.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true"))
    config: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        # Explicit values from the accelerate config are kept so a contradiction with the training keys
        # is reported before training instead of one side silently winning.
        "gradient_accumulation_steps": _number_or_auto(env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), int),
        "gradient_clipping": _number_or_auto(env.get("ACCELERATE_GRADIENT_CLIPPING"), float),
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
    }
    return config


def _number_or_auto(value: str | None, kind: type) -> Any:
    return kind(value) if _is_set(value) else "auto"
