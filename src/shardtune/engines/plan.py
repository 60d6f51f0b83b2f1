"""Which engine a run uses and with what settings, decided on the launching host (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardtune.config.schema import TrainConfig
from shardtune.engines.fsdp_config import FsdpSettings, is_fsdp_requested, resolve_fsdp_settings

ENGINE_KINDS = ("local", "ddp", "fsdp", "deepspeed")


@dataclass(frozen=True)
class EnginePlan:
    kind: str
    fsdp: FsdpSettings | None = None
    deepspeed_raw: dict[str, Any] | None = None
    deepspeed_source: str | None = None

    @property
    def needs_process_group(self) -> bool:
        return self.kind != "local"


def plan_engine(c: TrainConfig, world_size: int, has_cuda: bool) -> tuple[EnginePlan, list[str]]:
    """Pick DeepSpeed / FSDP when configured, DDP for several processes, else local; list every problem."""
    plan, problems = _choose_engine(c, world_size, has_cuda)
    return plan, (problems + quantization_problems(c, plan, has_cuda) + adapter_problems(c, plan)
                  + optimizer_problems(c, plan) + reference_model_problems(c, plan))


# Why each LLaMA-Factory optimizer replacement needs whole (replicated) weights: one process or DDP.
_WHOLE_WEIGHTS = {
    "use_muon": "Muon orthogonalises each weight's whole 2-D update (Newton-Schulz on the full matrix), and FSDP/ZeRO "
                "give each rank a shard or a flattened slice",
    "use_galore": "GaLore projects each whole weight's gradient onto its top singular vectors, and FSDP/ZeRO give each "
                  "rank a shard (LLaMA-Factory refuses GaLore with DeepSpeed too)",
    "use_apollo": "APOLLO projects each whole weight's gradient, and FSDP/ZeRO give each rank a shard (LLaMA-Factory "
                  "refuses APOLLO with DeepSpeed too)",
    "use_adam_mini": "Adam-mini splits each whole attention weight into heads to share one second moment per head, "
                     "and FSDP/ZeRO give each rank a flattened shard",
}


def optimizer_problems(c: TrainConfig, plan: EnginePlan) -> list[str]:
    """LLaMA-Factory's optimizer replacements work on whole weights: one process and DDP, not FSDP or ZeRO."""
    if plan.kind in ("local", "ddp"):
        return []
    on = {"use_muon": c.use_muon, "use_galore": c.use_galore, "use_apollo": c.use_apollo,
          "use_adam_mini": c.use_adam_mini}
    label = "fsdp" if plan.kind == "fsdp" else "deepspeed"
    return [f"{key} (true) with {label}: {_WHOLE_WEIGHTS[key]}; train on one process or with DDP (no deepspeed/fsdp)"
            for key, value in on.items() if value]


def adapter_problems(c: TrainConfig, plan: EnginePlan) -> list[str]:
    """Adapter settings a sharding engine cannot build: it creates the model without its weights."""
    zero3 = plan.kind == "deepspeed" and _zero_stage(plan) == 3
    problems = []
    if c.pissa_init and (plan.kind == "fsdp" or zero3):
        problems.append(f"pissa_init (true) with {_engine_label(plan)}: PiSSA takes the SVD of each whole base weight "
                        "and rewrites it while the model is built, which a sharding engine never holds; use DDP or "
                        "ZeRO-0/1/2 (LLaMA-Factory refuses it under ZeRO-3 too)")
    if c.use_dora and zero3:
        # peft reads each base weight outside its layer's forward (the norm of W + BA), where ZeRO-3 has released it.
        problems.append("use_dora (true) with DeepSpeed ZeRO-3: DoRA needs each layer's whole base weight outside "
                        "that layer's forward, where ZeRO-3 holds only a partition; use fsdp (full_shard auto_wrap, "
                        "fsdp_version 2) to shard a DoRA run, or ZeRO-2")
    return problems


def reference_model_problems(c: TrainConfig, plan: EnginePlan) -> list[str]:
    """dpo/kto without LoRA keep a frozen copy of the model as the reference: a plain replica on every rank. Where
    the policy is sharded that copy would be whole on each rank, so it is refused until the reference is sharded
    the same way."""
    if c.stage == "rm" and plan.kind in ("fsdp", "deepspeed"):
        return [f"stage rm under {_engine_label(plan)}: the reward model is assembled from the loaded causal LM "
                "(its body under a new score layer), which the engines' own loading and saving paths do not do yet; "
                "train it on one process or with DDP (no deepspeed/fsdp key)"]
    needs_copy = (c.stage == "kto" or (c.stage == "dpo" and c.pref_loss not in ("orpo", "simpo"))) \
        and c.finetuning_type != "lora" and not c.precompute_ref_log_probs
    if not needs_copy or not (plan.kind == "fsdp" or (plan.kind == "deepspeed" and _zero_stage(plan) == 3)):
        return []
    return [f"stage {c.stage} with finetuning_type {c.finetuning_type} under {_engine_label(plan)}: the frozen "
            "reference copy is not sharded yet and would be held whole on every rank; use finetuning_type: lora "
            "(the reference is the model with adapters off), precompute_ref_log_probs: true (no copy), pref_loss "
            "orpo or simpo (no reference), or DDP / ZeRO-0/1/2"]


def _engine_label(plan: EnginePlan) -> str:
    return "fsdp" if plan.kind == "fsdp" else f"DeepSpeed ZeRO-{_zero_stage(plan)}"


def _choose_engine(c: TrainConfig, world_size: int, has_cuda: bool) -> tuple[EnginePlan, list[str]]:
    wants_fsdp = is_fsdp_requested(c.fsdp, c.fsdp_config)
    if c.deepspeed and wants_fsdp:
        return EnginePlan("local"), [f"deepspeed ({_short(c.deepspeed)}) and fsdp ({_short(c.fsdp or c.fsdp_config)})"
                                     " are both set; choose one engine"]
    if c.deepspeed:
        plan, problems = _plan_deepspeed(c)
        if c.pure_bf16:
            problems.append("pure_bf16 (true) with deepspeed: shardtune does not yet drive DeepSpeed's bf16 master "
                            "weights (bf16_master_weights_and_grads); use bf16: true, or pure_bf16 with DDP")
        if c.fp16 and not has_cuda:
            problems.append("fp16 (true) with deepspeed needs a GPU: DeepSpeed's CPU accelerator has no fp16; "
                            "use bf16: true")
        return plan, problems
    if wants_fsdp:
        return _plan_fsdp(c, has_cuda, world_size)
    return EnginePlan("ddp" if world_size > 1 else "local"), []


def _plan_deepspeed(c: TrainConfig) -> tuple[EnginePlan, list[str]]:
    from shardtune.engines.deepspeed_config import load_deepspeed_setting
    from shardtune.errors import ConfigError

    try:
        raw, source = load_deepspeed_setting(c.deepspeed)
    except ConfigError as err:
        return EnginePlan("deepspeed"), err.problems
    return EnginePlan("deepspeed", deepspeed_raw=raw, deepspeed_source=source), []


def _plan_fsdp(c: TrainConfig, has_cuda: bool, world_size: int) -> tuple[EnginePlan, list[str]]:
    fsdp_config = c.fsdp_config
    problems: list[str] = []
    if isinstance(fsdp_config, str):
        fsdp_config, problems = _load_fsdp_config_file(fsdp_config, world_size)
    settings, more = resolve_fsdp_settings(c.fsdp, fsdp_config)
    problems += more
    if c.pure_bf16:
        problems.append("pure_bf16 (true) with fsdp: shardtune's FSDP keeps fp32 sharded master weights; use bf16: "
                        "true (bf16 compute, fp32 master), or pure_bf16 with DDP")
    if c.fp16:
        problems.append("fp16 (true) with fsdp: sharded gradients cannot be unscaled by torch's GradScaler; "
                        "use bf16: true")
    if settings.offload_params and settings.version == 1 and not has_cuda:
        problems.append("fsdp offload_params (true) with fsdp_version 1 pins memory and fails without a GPU; "
                        "use fsdp_version: 2 (offload without pinned memory)")
    return EnginePlan("fsdp", fsdp=settings), problems


def _load_fsdp_config_file(path: str, world_size: int) -> tuple[dict[str, Any], list[str]]:
    """An FSDP settings file, or an accelerate config file whose `fsdp_config` section is used."""
    from pathlib import Path

    from shardtune.config.load import load_yaml_file
    from shardtune.errors import ConfigError

    if not Path(path).is_file():
        return {}, [f"fsdp_config: file not found: {path}"]
    try:
        data = load_yaml_file(path)
    except ConfigError as err:
        return {}, err.problems
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


PRE_QUANTIZED = ("gptq", "awq", "aqlm", "eetq", "hqq", "exl2", "fp8", "compressed-tensors", "bitnet")


def quantization_problems(c: TrainConfig, plan: EnginePlan, has_cuda: bool) -> list[str]:
    """QLoRA rules: 4-bit bitsandbytes on CUDA; what FSDP and ZeRO-3 cannot shard is refused with the reason."""
    method = _checkpoint_quant_method(c.model_name_or_path)
    problems = []
    if method and plan.kind in ("fsdp", "deepspeed"):
        problems.append(f"model_name_or_path is a pre-quantized ({method}) checkpoint: {plan.kind} cannot shard its "
                        "packed weights; use an unquantized model with quantization_bit: 4")
    if c.quantization_bit is None:
        return problems
    if method:
        problems.append(f"quantization_bit ({c.quantization_bit}): the model is already quantized ({method}); "
                        "remove quantization_bit")
    if not has_cuda:
        problems.append(f"quantization_bit ({c.quantization_bit}) needs a CUDA GPU and bitsandbytes; none is "
                        "visible here. Remove quantization_bit to train in full precision.")
    if plan.kind == "fsdp" and c.quantization_bit == 8:
        problems.append("quantization_bit (8) with fsdp: 8-bit bitsandbytes weights cannot be sharded; use 4")
    if plan.kind == "fsdp" and c.quantization_bit == 4 and not c.bf16:
        # See engines/fsdp_qlora.py: 4-bit weights stored as fp32 would be all-gathered as floats.
        problems.append("quantization_bit (4) with fsdp needs bf16: true (the 4-bit weights are stored in the compute "
                        "dtype so that FSDP can shard them; shardtune shards them in bf16 only)")
    if plan.kind == "deepspeed" and _zero_stage(plan) == 3:
        problems.append(f"quantization_bit ({c.quantization_bit}) with DeepSpeed ZeRO-3: bitsandbytes weights "
                        "cannot be partitioned; use FSDP (fsdp: full_shard auto_wrap) for sharded QLoRA, or ZeRO-2")
    return problems


def _checkpoint_quant_method(model: str | None) -> str | None:
    from shardtune.model.folder import read_config_json

    quant = (read_config_json(model or "") or {}).get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    return method if method in PRE_QUANTIZED else None


def _zero_stage(plan: EnginePlan) -> int:
    zero = (plan.deepspeed_raw or {}).get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
