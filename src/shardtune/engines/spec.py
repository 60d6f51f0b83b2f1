"""What each engine knows about itself, as one small record the rest of shardtune asks.

The planner (engines/plan.py) asks an engine for its refusal rules, the estimate for how it places model states,
the dry run for its description and resolved settings, export for its checkpoint layouts and their readers, and
``build_engine`` for the engine class (named, so this light record never imports torch or the engine). Each
engine's record lives in its own import-light module (engines/replicated.py, deepspeed_config.py,
fsdp_config.py; no torch import at module level) and is registered in engines/plan.py: adding an engine is one
module and one line there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from shardtune.config.schema import TrainConfig
    from shardtune.engines.engine_plan import EnginePlan
    from shardtune.world import WorldLayout


@dataclass(frozen=True)
class MemoryLayout:
    """How an engine places model states across the ranks, in the memory estimate's terms."""

    option: str  # the estimate's option name, e.g. "DDP", "ZeRO-3+offload", "FSDP SHARD_GRAD_OP"
    family: str  # "replicated", "deepspeed" (ZeRO settings from the DeepSpeed config) or "fsdp"
    reshard_after_forward: bool = False  # fsdp: gathered parameters freed after forward (ZeRO-3-like)
    offload: bool = False  # fsdp: parameters and optimizer states in CPU memory
    hybrid: bool = False  # fsdp: sharded within a group, replicated across groups
    shard_group: int | None = None  # fsdp hybrid: ranks per shard group (None: the ranks of a node)


@dataclass(frozen=True)
class CheckpointLayout:
    """How an engine writes a checkpoint-<step> folder's weights, and how one process reads them back."""

    name: str  # the layout's name in messages and in export
    marker: str  # the file or folder whose presence identifies the layout
    read: Callable[[torch.nn.Module, Path], dict[str, Any]]  # (the trained model's structure, folder) -> state

    def holds(self, folder: Path) -> bool:
        return (folder / self.marker).exists()


@dataclass(frozen=True)
class EngineSpec:
    kind: str  # EnginePlan.kind
    describe: Callable[[EnginePlan], str]  # the dry run's engine line
    resolved_settings: Callable[[EnginePlan, TrainConfig, WorldLayout], dict | None]  # what the dry run prints
    refusals: Callable[[TrainConfig, EnginePlan, bool], list[str]]  # (config, plan, has_cuda) -> problems
    memory_layout: Callable[[EnginePlan], MemoryLayout]
    # whether each rank gathers whole layers from shards and frees them again, step after step (FSDP, ZeRO-3)
    gathers_parameters: Callable[[EnginePlan], bool]
    # "module:Class" of the Engine, imported only when a rank builds it; Class.from_plan(config, plan, ctx, precision)
    engine: str
    checkpoints: tuple[CheckpointLayout, ...] = ()


# Why each LLaMA-Factory optimizer replacement needs whole (replicated) weights: one process or DDP (Muon: FSDP2 too).
_WHOLE_WEIGHTS = {
    "use_muon": "Muon orthogonalises each weight's whole 2-D update (Newton-Schulz on the full matrix), which "
                "shardtune gathers from FSDP2's row shards, but FSDP1 and ZeRO flatten the weights into slices that "
                "no longer hold a matrix",
    "use_galore": "GaLore projects each whole weight's gradient onto its top singular vectors, and FSDP/ZeRO give each "
                  "rank a shard (LLaMA-Factory refuses GaLore with DeepSpeed too)",
    "use_apollo": "APOLLO projects each whole weight's gradient, and FSDP/ZeRO give each rank a shard (LLaMA-Factory "
                  "refuses APOLLO with DeepSpeed too)",
    "use_adam_mini": "Adam-mini splits each whole attention weight into heads to share one second moment per head, "
                     "and FSDP/ZeRO give each rank a flattened shard",
    "use_badam": "BAdam makes another block of layers trainable every badam_switch_interval steps and steps fp32 "
                 "copies of its whole weights, and FSDP/ZeRO fix the trainable set and shard it at set-up "
                 "(LLaMA-Factory's ZeRO-3 path rebuilds DeepSpeed's partitions through its internals; not here)",
}


def whole_weight_optimizer_problems(c: TrainConfig, label: str, shards_rows: bool = False) -> list[str]:
    """A sharding engine (``label``) refuses LLaMA-Factory's optimizer replacements: they work on whole weights.
    An engine that ``shards_rows`` (FSDP2: DTensors split on dim 0) runs Muon (optim/sharded_muon.py)."""
    on = {"use_muon": c.use_muon and not shards_rows, "use_galore": c.use_galore, "use_apollo": c.use_apollo,
          "use_adam_mini": c.use_adam_mini, "use_badam": c.use_badam}
    remedy = {"use_muon": "train with fsdp_version: 2, on one process or with DDP",
              "use_badam": "train on one process (NPROC_PER_NODE=1, no deepspeed/fsdp)"}
    return [f"{key} (true) with {label}: {_WHOLE_WEIGHTS[key]}; "
            f"{remedy.get(key, 'train on one process or with DDP (no deepspeed/fsdp)')}" for key, value in on.items()
            if value]


def one_process_optimizer_problems(c: TrainConfig, label: str) -> list[str]:
    """Layer-wise GaLore/APOLLO and BAdam under several processes (``label``: the engine): refused (LLaMA-Factory
    refuses the first two, and runs BAdam on several processes only under ZeRO-3, which shardtune refuses too)."""
    from shardtune.optim.settings import layerwise_key

    key = layerwise_key(c)
    problems = [f"{key} (true) with {label}: each weight steps inside the backward as soon as its own gradient is "
                "complete, before the processes could average it (LLaMA-Factory refuses distributed layer-wise "
                f"training too); train on one process (NPROC_PER_NODE=1) or set {key}: false"] if key else []
    if c.use_badam:
        problems.append(f"use_badam (true) with {label}: DDP registers the trainable weights once, at set-up, and "
                        "BAdam changes them at every block switch; train on one process (NPROC_PER_NODE=1)")
    return problems


def depth_problems(c: TrainConfig, label: str) -> list[str]:
    """A sharding engine (``label``) never holds the whole model the routers of mixture of depths are added to."""
    return [f"mixture_of_depths ({c.mixture_of_depths}) with {label}: the routers are added to the whole model "
            "while it is built, which a sharding engine never holds; use DDP or ZeRO-0/1/2"] \
        if c.mixture_of_depths else []


def pissa_problems(c: TrainConfig, label: str) -> list[str]:
    """A sharding engine (``label``) never holds the whole base weights PiSSA's initialisation rewrites."""
    return [f"pissa_init (true) with {label}: PiSSA takes the SVD of each whole base weight and rewrites it while "
            "the model is built, which a sharding engine never holds; use DDP or ZeRO-0/1/2 (LLaMA-Factory refuses "
            "it under ZeRO-3 too)"] if c.pissa_init else []


def pre_quantized_problems(c: TrainConfig, kind: str) -> list[str]:
    """A sharding engine cannot shard a pre-quantized checkpoint's packed weights."""
    from shardtune.model.folder import pre_quantized_method

    method = pre_quantized_method(c.model_name_or_path)
    return [f"model_name_or_path is a pre-quantized ({method}) checkpoint: {kind} cannot shard its packed weights; "
            "use an unquantized model with quantization_bit: 4"] if method else []


def preference_problems(c: TrainConfig, label: str, shards_weights: bool) -> list[str]:
    """Preference runs a sharding engine (``label``) does not run yet: a ref_model that must be whole on every rank
    (adapters merged into it, bitsandbytes weights) where the policy is sharded. A full-parameter dpo/kto reference
    is loaded by the engine and placed as the policy (``Engine.load_frozen``); a reward model's score layer is
    placed with its body (model/reward_head.py)."""
    problems = []
    if c.ref_model_adapters and shards_weights:
        problems.append(f"ref_model_adapters with {label}: merging adapters needs the whole ref_model on each "
                        "process, which a sharding engine never loads; merge them first (shardtune export) and give "
                        "the merged folder as ref_model")
    if c.ref_model_quantization_bit is not None and shards_weights:
        problems.append(f"ref_model_quantization_bit ({c.ref_model_quantization_bit}) with {label}: bitsandbytes "
                        "weights are not sharded here and would be whole on every rank; use DDP or ZeRO-0/1/2, or "
                        "remove it")
    return problems


def compile_problems(c: TrainConfig, label: str, engine_reason: str | None = None) -> list[str]:
    """torch_compile's limits under an engine (``label``): the engine's own reason (``engine_reason``) and what no
    engine runs compiled yet."""
    if not c.torch_compile:
        return []
    problems = [f"torch_compile (true) with {label}: {engine_reason}"] if engine_reason else []
    if c.quantization_bit is not None:
        problems.append(f"torch_compile (true) with quantization_bit ({c.quantization_bit}): bitsandbytes' 4/8-bit "
                        "kernels are not traceable (every layer would break its graph); set torch_compile: false")
    if c.gradient_checkpointing:
        problems.append("torch_compile (true) with gradient_checkpointing (true): compiled layers under transformers' "
                        "activation checkpointing are not checked by shardtune yet; turn one of them off")
    return problems


def float8_problems(c: TrainConfig, label: str, engine_reason: str | None = None,
                    all_gathers_float8: bool = False) -> list[str]:
    """fp8 under an engine (``label``): the engine's own reason, and the float8 all-gather, which only an engine that
    all-gathers torchao's weight wrappers (``all_gathers_float8``: FSDP2) can honour."""
    if not (c.fp8 or c.fp8_enable_fsdp_float8_all_gather):
        return []
    problems = [f"fp8 (true) with {label}: {engine_reason}"] if engine_reason else []
    if c.fp8_enable_fsdp_float8_all_gather and not all_gathers_float8:
        problems.append(f"fp8_enable_fsdp_float8_all_gather (true) with {label}: only FSDP2 (fsdp_version 2) "
                        "all-gathers weights as float8; set it to false (fp8: true alone trains in float8)")
    return problems
