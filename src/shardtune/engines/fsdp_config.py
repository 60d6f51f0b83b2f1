"""FSDP settings (``FsdpSettings``, engines/engine_plan.py) from the Hugging Face `fsdp` / `fsdp_config` keys or
accelerate's variables (pure functions), and the FSDP engine's record."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtune.engines.engine_plan import EnginePlan, FsdpSettings
from shardtune.engines.spec import (
    CheckpointLayout,
    EngineSpec,
    MemoryLayout,
    compile_problems,
    depth_problems,
    float8_problems,
    pissa_problems,
    pre_quantized_problems,
    preference_problems,
    whole_weight_optimizer_problems,
)
from shardtune.errors import ModelError
from shardtune.model.folder import model_config_json
from shardtune.model.moe import expert_count, fsdp1_fused_lora_problem, targets_fused_experts

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
FSDP_WORDS = {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap"}


# fsdp_config key (HF spelling without the "fsdp_" prefix) -> FsdpSettings field.
_KEYS = {
    "version": "version",
    "sharding_strategy": "sharding_strategy",
    "reshard_after_forward": "sharding_strategy",
    "offload_params": "offload_params",
    "auto_wrap_policy": "auto_wrap_policy",
    "transformer_layer_cls_to_wrap": "transformer_layer_cls_to_wrap",
    "min_num_params": "min_num_params",
    "state_dict_type": "state_dict_type",
    "backward_prefetch": "backward_prefetch",
    "forward_prefetch": "forward_prefetch",
    "cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
    "sync_module_states": "sync_module_states",
    "use_orig_params": "use_orig_params",
    "hsdp_shard_size": "hsdp_shard_size",
    "activation_checkpointing": None,  # use gradient_checkpointing
}


def fsdp_words(fsdp: Any) -> list[str]:
    """The HF `fsdp` key: a string like 'full_shard auto_wrap', a list, or true."""
    if fsdp in (None, False, "", []):
        return []
    if fsdp is True:
        return ["full_shard", "auto_wrap"]
    if isinstance(fsdp, str):
        return fsdp.replace(",", " ").split()
    return [str(w) for w in fsdp]


def is_fsdp_requested(fsdp: Any, fsdp_config: Any) -> bool:
    return bool(fsdp_words(fsdp)) or bool(fsdp_config)


def resolve_fsdp_settings(fsdp: Any, fsdp_config: dict[str, Any] | None) -> tuple[FsdpSettings, list[str]]:
    """Merge the `fsdp` words and `fsdp_config` mapping into settings; return (settings, problems)."""
    problems: list[str] = []
    values: dict[str, Any] = {}
    for word in fsdp_words(fsdp):
        word = word.lower()
        if word not in FSDP_WORDS:
            problems.append(f"fsdp: unknown option '{word}'; use any of {', '.join(sorted(FSDP_WORDS))}")
        elif word == "offload":
            values["offload_params"] = True
        elif word == "auto_wrap":
            values.setdefault("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
        else:
            values["sharding_strategy"] = word.upper()
    # What the fsdp words said: fsdp_config may add to it, not silently overrule it (auto_wrap takes any policy).
    from_words = {k: v for k, v in values.items() if k != "auto_wrap_policy"}
    for raw_key, raw_value in (fsdp_config or {}).items():
        key = raw_key[5:] if raw_key.startswith("fsdp_") else raw_key
        if key not in _KEYS:
            close = difflib.get_close_matches(key, list(_KEYS), n=1)
            hint = f" (did you mean 'fsdp_{close[0]}'?)" if close else ""
            problems.append(f"fsdp_config: unknown key '{raw_key}'{hint}")
            continue
        setting_name = _KEYS[key]
        if setting_name is None:
            problems.append(f"fsdp_config: '{raw_key}' is not supported; set gradient_checkpointing: true instead")
            continue
        try:
            value = _convert(key, raw_value)
        except ValueError as err:
            problems.append(f"fsdp_config: {raw_key}: {err}")
            continue
        if setting_name in from_words and value != from_words[setting_name]:
            problems.append(f"fsdp ({' '.join(fsdp_words(fsdp))}) and fsdp_config {raw_key} ({raw_value}) contradict "
                            f"each other ({setting_name}: {from_words[setting_name]} vs {value}); keep one")
            continue
        values[setting_name] = value
    settings = FsdpSettings(**values)
    return settings, problems + settings_problems(settings)


def fsdp_async_save_problems(async_save: bool, settings: FsdpSettings) -> list[str]:
    """FSDP1's sharded state dict holds ShardedTensors, which torch's asynchronous checkpoint cannot stage."""
    if async_save and settings.version == 1 and settings.state_dict_type == "SHARDED_STATE_DICT":
        return ["async_save (true) with fsdp_version 1 and fsdp_state_dict_type SHARDED_STATE_DICT: FSDP1's shards "
                "are ShardedTensors, which torch's asynchronous checkpoint cannot copy to host memory; use "
                "fsdp_version: 2, or fsdp_state_dict_type: FULL_STATE_DICT, or remove async_save"]
    return []


def _convert(key: str, value: Any) -> Any:
    if key == "version":
        if _whole(value) not in (1, 2):
            raise ValueError(f"{value!r} must be 1 or 2")
        return _whole(value)
    if key == "reshard_after_forward":
        return "FULL_SHARD" if _to_bool(value) else "SHARD_GRAD_OP"
    if key == "sharding_strategy":
        return _choice(value, STRATEGIES, numbered=True)
    if key == "auto_wrap_policy":
        return _choice(value, WRAP_POLICIES)
    if key == "state_dict_type":
        return _choice(value, STATE_DICT_TYPES)
    if key == "backward_prefetch":
        return _choice(value, PREFETCH)
    if key == "transformer_layer_cls_to_wrap":
        if not isinstance(value, (str, list, tuple)):
            raise ValueError(f"{value!r}: give layer class names, e.g. LlamaDecoderLayer (comma separated or a list)")
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(str(v).strip() for v in items if str(v).strip())
    if key in ("min_num_params", "hsdp_shard_size"):
        return _whole(value)
    return _to_bool(value)


def _whole(value: Any) -> int:
    """A whole number, written as one (1e8 and "100000000" too); anything else is the key's problem, in a line."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not a whole number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a whole number") from None
    if not number.is_integer():
        raise ValueError(f"{value!r} is not a whole number")
    return int(number)


def _choice(value: Any, allowed: tuple[str, ...], numbered: bool = False) -> str:
    text = str(value).strip().upper()
    if numbered and text.isdigit() and 1 <= int(text) <= len(allowed):
        return allowed[int(text) - 1]  # accelerate numbers strategies from 1
    if text not in allowed:
        raise ValueError(f"{value!r} is not allowed; choose one of: {', '.join(allowed)}")
    return text


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{value!r} is not true/false")


def settings_problems(s: FsdpSettings) -> list[str]:
    problems = []
    if s.version == 2 and s.backward_prefetch == "BACKWARD_POST":
        problems.append("fsdp_config: backward_prefetch (BACKWARD_POST) applies to fsdp_version 1; FSDP2 prefetches "
                        "the next unit before each backward (BACKWARD_PRE) or, with NO_PREFETCH, not at all")
    if s.hsdp_shard_size is not None and not s.is_hybrid:
        problems.append(f"fsdp_config: hsdp_shard_size ({s.hsdp_shard_size}) only applies to HYBRID_SHARD strategies"
                        f" (sharding_strategy is {s.sharding_strategy})")
    if s.cpu_ram_efficient_loading and not s.sync_module_states:
        problems.append("fsdp_config: cpu_ram_efficient_loading (true) needs sync_module_states (true): only rank 0 "
                        "loads weights and the others receive them")
    return problems


def fsdp1_strategy_member(strategy: str) -> str:
    """The ``torch.distributed.fsdp.ShardingStrategy`` member name; torch spells hybrid ZeRO-2 as a private one."""
    return "_HYBRID_SHARD_ZERO2" if strategy == "HYBRID_SHARD_ZERO2" else strategy


def reshards_after_forward(strategy: str) -> bool:
    """FSDP2's ``reshard_after_forward``: the ZeRO-3-like strategies free the gathered parameters after forward,
    the ZeRO-2-like ones (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2) keep them for backward (NO_SHARD has none to free)."""
    return strategy in ("FULL_SHARD", "HYBRID_SHARD")


# --- the engine's record (engines/spec.py) ---

DCP_DIR = "fsdp_state"  # SHARDED_STATE_DICT checkpoints: a torch distributed checkpoint, one file per rank
FULL_STATE_FILE = "fsdp_full_state.pt"  # FULL_STATE_DICT checkpoints: rank 0 writes the gathered states


def read_sharded_checkpoint(model: Any, folder: Path) -> dict[str, Any]:
    """Gather a torch distributed checkpoint in this one process (DCP reshards to the reader's layout)."""
    from shardtune.engines.safe_load import load_dcp_weights_only

    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    load_dcp_weights_only(state, folder / DCP_DIR)
    return state["model"]


def read_full_checkpoint(model: Any, folder: Path) -> dict[str, Any]:
    import torch

    # Memory-mapped: the optimizer state beside the weights is never read.
    return torch.load(folder / FULL_STATE_FILE, map_location="cpu", weights_only=True, mmap=True)["model"]


def fsdp_refusals(c: TrainConfig, plan: EnginePlan, has_cuda: bool) -> list[str]:
    """What shardtune does not run under FSDP, each with the reason and what to use instead."""
    settings = plan.fsdp or FsdpSettings()
    problems = []
    if c.pure_bf16:
        problems.append("pure_bf16 (true) with fsdp: shardtune's FSDP keeps fp32 sharded master weights; use bf16: "
                        "true (bf16 compute, fp32 master), or pure_bf16 with DDP")
    if c.fp16:
        problems.append("fp16 (true) with fsdp: sharded gradients cannot be unscaled by torch's GradScaler; "
                        "use bf16: true")
    if settings.offload_params and settings.version == 1 and not has_cuda:
        problems.append("fsdp offload_params (true) with fsdp_version 1 pins memory and fails without a GPU; "
                        "use fsdp_version: 2 (offload without pinned memory)")
    problems += pre_quantized_problems(c, "fsdp")
    if c.quantization_bit == 8:
        problems.append("quantization_bit (8) with fsdp: 8-bit bitsandbytes weights cannot be sharded; use 4")
    if c.quantization_bit == 4 and not c.bf16:
        # See engines/fsdp_qlora.py: 4-bit weights stored as fp32 would be all-gathered as floats.
        problems.append("quantization_bit (4) with fsdp needs bf16: true (the 4-bit weights are stored in the compute "
                        "dtype so that FSDP can shard them; shardtune shards them in bf16 only)")
    if settings.version == 1 and c.finetuning_type == "lora":
        problems += fsdp1_fused_lora_problems(c)
    if settings.version == 1 and c.rollout_backend == "vllm_protocol_cpu":
        problems.append("rollout_backend (vllm_protocol_cpu) with fsdp_version 1: the weight sync gathers single "
                        "weights, and FSDP1's flat parameters gather by wrapped unit only; use fsdp_version: 2")
    fsdp1_compile = ("FSDP1 flattens each unit's parameters into one, which compiled layers would read as views; "
                     "use fsdp_version: 2 (compile, then fully_shard)") if settings.version == 1 else None
    fsdp1_float8 = ("torchao's float8 layers are built for FSDP2's per-parameter shards, FSDP1 flattens them; use "
                    "fsdp_version: 2") if settings.version == 1 else None
    return (problems + pissa_problems(c, "fsdp") + depth_problems(c, "fsdp")
            + whole_weight_optimizer_problems(c, f"fsdp (fsdp_version {settings.version})", settings.version == 2)
            + preference_problems(c, "fsdp", shards_weights=True) + compile_problems(c, "fsdp", fsdp1_compile)
            + float8_problems(c, f"fsdp (fsdp_version {settings.version})", fsdp1_float8, settings.version == 2))


def fsdp1_qlora_problems(c: TrainConfig, settings: FsdpSettings, world_size: int) -> list[str]:
    """FSDP1 QLoRA shards its frozen 4-bit units beside the LoRA units only with several processes, a path that has
    never run (it needs CUDA GPUs, and the GPU tier has had one): refused rather than trusted."""
    if settings.version != 1 or c.quantization_bit is None or world_size < 2:
        return []
    return [f"quantization_bit ({c.quantization_bit}) with fsdp_version 1 on {world_size} processes: FSDP1 QLoRA has "
            "been run on one GPU only; use fsdp_version: 2 (the default), which shards QLoRA across GPUs"]


def fsdp1_fused_lora_problems(c: TrainConfig) -> list[str]:
    """Before launch, from config.json: LoRA that would adapt fused expert weights (the ranks check the rest)."""
    try:
        config = model_config_json(c.model_name_or_path)
    except ModelError:
        return []  # reported by the folder checks
    if config is None or not targets_fused_experts(config, c.lora_target):
        return []
    return [fsdp1_fused_lora_problem(f"gate_up_proj and down_proj of {expert_count(config)} experts per MoE "
                                     f"layer, chosen by lora_target {','.join(c.lora_target)}")]


def fsdp_memory_layout(plan: EnginePlan) -> MemoryLayout:
    s = plan.fsdp or FsdpSettings()
    if s.sharding_strategy == "NO_SHARD":
        return MemoryLayout("DDP", "replicated")
    name = "FSDP offload" if s.offload_params else {"FULL_SHARD": "FSDP FULL_SHARD",
                                                   "SHARD_GRAD_OP": "FSDP SHARD_GRAD_OP"}.get(s.sharding_strategy,
                                                                                              "FSDP HYBRID_SHARD")
    return MemoryLayout(name, "fsdp", reshard_after_forward=reshards_after_forward(s.sharding_strategy),
                        offload=s.offload_params, hybrid=s.is_hybrid, shard_group=s.hsdp_shard_size)


FSDP = EngineSpec(
    kind="fsdp",
    describe=lambda plan: f"fsdp{plan.fsdp.version} {plan.fsdp.sharding_strategy}" if plan.fsdp else "fsdp",
    resolved_settings=lambda plan, config, layout: plan.fsdp.to_dict() if plan.fsdp else None,
    refusals=fsdp_refusals,
    memory_layout=fsdp_memory_layout,
    gathers_parameters=lambda plan: True,
    engine="shardtune.engines.fsdp:FSDPEngine",
    checkpoints=(CheckpointLayout("fsdp_sharded", DCP_DIR, read_sharded_checkpoint),
                 CheckpointLayout("fsdp_full", FULL_STATE_FILE, read_full_checkpoint)),
)
