"""``expert_parallel_size`` under DeepSpeed ZeRO: DeepSpeed's own AutoEP (its ``expert_parallel`` config section),
translated from our key and refused where it is not exact here. Pure: no torch, no deepspeed import (the launching
host's checks and the dry run read it); the rank-side part is deepspeed_autoep_runtime.py.

What was measured (DeepSpeed 0.19.8, transformers 5.23, 2 and 4 gloo CPU processes, fp32, tests/distributed/
test_expert_parallel.py): ZeRO-1/2 with AutoEP train Qwen3-MoE, Qwen2-MoE, Mixtral and DeepSeek-V3 (full) with
per-step loss, aux loss, gradient norm and final weights within 4e-6 of one process, and ZeRO-3 (Qwen3-MoE) as
exactly, its model saved by gathering module by module (DeepSpeed's own consolidation refuses AutoEP's experts:
deepspeed_autoep_runtime.py). ZeRO-0's reported norm is off; LoRA trips DeepSpeed's assertion: the refusals below
say so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardtune.engines.deepspeed_config import zero_shard_writers
from shardtune.run_files import RESOLVED_CONFIG

# model_type -> AutoEP preset (deepspeed/module_inject/auto_ep_presets), the families measured here.
AUTOEP_PRESETS = {"qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen3_moe", "mixtral": "mixtral",
                  "deepseek_v3": "deepseek_v3"}
# The presets' block pattern, also under a peft wrapper (AutoEP full-matches module names).
MOE_LAYER_PATTERN = r"(?:base_model\.model\.)?model\.layers\.\d+\.mlp"
SUPPORTED_STAGES = (1, 2, 3)
FIX = "set expert_parallel_size: 1"
FSDP2 = "use FSDP2 (fsdp: full_shard, fsdp_version: 2)"

STAGE_REASONS = {
    0: "DeepSpeed's ZeRO-0 clips with the average of the ranks' norms (runtime/utils.py clip_grad_norm_), each "
       "counting only the experts its rank holds: measured 1.3% under the true norm, and the weights 1e-5 off one "
       "process after 3 steps",
}


def autoep_section(expert_parallel_size: int, model_type: str) -> dict[str, Any]:
    """DeepSpeed's ``expert_parallel`` section for ``expert_parallel_size`` ranks per expert group."""
    return {"enabled": True, "autoep_size": expert_parallel_size, "preset_model": AUTOEP_PRESETS[model_type],
            "moe_layer_pattern": MOE_LAYER_PATTERN}


def with_autoep(ds_config: dict, expert_parallel_size: int, model_type: str | None) -> dict:
    """The resolved config with the ``expert_parallel`` section when E > 1 (a copy; E = 1: unchanged)."""
    if expert_parallel_size == 1:
        return ds_config
    assert model_type in AUTOEP_PRESETS, f"refused before launch: {model_type}"
    return {**ds_config, "expert_parallel": autoep_section(expert_parallel_size, model_type)}


def autoep_enabled(ds_config: dict) -> bool:
    return bool((ds_config.get("expert_parallel") or {}).get("enabled"))


def autoep_problems(key: str, stage: int, family: str, finetuning_type: str | None = None,
                    offloads: bool = False) -> list[str]:
    """Why AutoEP cannot run this ZeRO stage, family and finetuning exactly, one line naming all three."""
    where = f"{key} with deepspeed (ZeRO stage {stage}) on {family}"
    if stage not in SUPPORTED_STAGES:
        return [f"{where}: {STAGE_REASONS.get(stage, 'not a ZeRO stage')}; use ZeRO stage 1, 2 or 3, {FSDP2}, or {FIX}"]
    if family not in AUTOEP_PRESETS:  # also "this model" (the estimate's question: a family it does not model)
        known = ", ".join(sorted(AUTOEP_PRESETS))
        return [f"{where}: DeepSpeed's AutoEP is driven here for {known} only (the families whose presets were "
                f"measured exact on this stack; the estimate models expert parallelism under FSDP2 only); {FSDP2}, "
                f"or {FIX}"]
    if finetuning_type not in (None, "full"):
        return [f"{where} and finetuning_type {finetuning_type}: with the experts frozen DeepSpeed 0.19.8's ZeRO "
                "stage 1/2 optimizer asserts 'The model has moe layers, but None of the param groups are marked as "
                f"MoE'; train full, {FSDP2}, or {FIX}"]
    if offloads:
        return [f"{where} and offload: AutoEP with ZeRO offload was not run on this stack; remove the offload "
                f"sections, or {FIX}"]
    return []


def checkpoint_expert_parallel_size(checkpoint_dir: Path) -> int:
    """The expert_parallel_size of the run that wrote a checkpoint (its copy of the run's config; 1 if unknown)."""
    try:
        return int(json.loads((checkpoint_dir / RESOLVED_CONFIG).read_text()).get("expert_parallel_size") or 1)
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def autoep_resume_problems(checkpoint_dir: Path | None, expert_parallel_size: int, world_size: int) -> list[str]:
    """A DeepSpeed checkpoint written with AutoEP (its per-expert files) holds AutoEP's module names: it resumes only
    under AutoEP on the world size that wrote it, and a checkpoint without them not under AutoEP."""
    tag = Path(checkpoint_dir) / "deepspeed" if checkpoint_dir is not None else None
    if tag is None or not tag.is_dir():
        return []
    written_with = checkpoint_expert_parallel_size(tag.parent)
    # ZeRO-1/2 write AutoEP's experts to files of their own; ZeRO-3 keeps them in its shards: its config says.
    with_experts = any(tag.glob("layer_*_expert_*_model_states.pt")) or written_with > 1
    writers = zero_shard_writers(tag)
    key = f"resume_from_checkpoint ({checkpoint_dir})"
    if with_experts and expert_parallel_size > 1 and written_with > 1 and written_with != expert_parallel_size:
        return [f"{key}: written with DeepSpeed's AutoEP over {written_with} ranks, whose expert shards shardtune "
                f"does not re-split; resume with expert_parallel_size: {written_with}"]
    if with_experts and expert_parallel_size == 1:
        return [f"{key}: written with DeepSpeed's AutoEP (expert_parallel_size > 1), whose module layout a run "
                "without it cannot load; resume with the expert_parallel_size that wrote it"]
    if not with_experts and expert_parallel_size > 1:
        return [f"{key}: written without expert parallelism, and expert_parallel_size ({expert_parallel_size}) "
                "under deepspeed replaces the MoE blocks with AutoEP's; resume with expert_parallel_size: 1"]
    if with_experts and writers and writers != world_size:
        return [f"{key}: written with DeepSpeed's AutoEP by {writers} processes, whose expert shards shardtune does "
                f"not re-split; resume on {writers} processes"]
    return []
