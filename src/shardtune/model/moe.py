"""What shardtune must know about a mixture-of-experts model, found from the model itself.

* The router's auxiliary (load-balancing) loss: transformers' MoE causal LMs (Qwen3-MoE, Mixtral, GPT-OSS in
  5.23) return ``aux_loss`` when called with ``output_router_logits=True`` and add ``router_aux_loss_coef x
  aux_loss`` to their own loss only when given labels. shardtune computes the LM loss itself (train/loss.py), so
  the term is added explicitly. DeepSeek-V3 balances its experts with a routing bias instead and returns no
  auxiliary loss (its config has no coefficient).
* The sparse MoE block: the module that owns both the experts and the router. DeepSpeed ZeRO-3 must treat it as
  one leaf (ranks that route to different experts would otherwise gather different parameters and hang), and
  LoRA must know which weights are routers (never adapted unless named) and which are fused experts.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the callers that pass models in; this module stays light to import
    import torch

# Attributes of a sparse block that hold the router (Qwen3-MoE/Mixtral/DeepSeek-V3: gate; GPT-OSS: router).
ROUTER_NAMES = ("gate", "router")
EXPERTS_NAME = "experts"


# The config key that counts the routed experts: Qwen-MoE, Mixtral/GPT-OSS, DeepSeek.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# transformers 5 stores the experts of every MoE family fused, as 3-D parameters with these names.
FUSED_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_count(config_json: dict) -> int:
    """Routed experts per MoE layer from a config.json (0 for a dense model)."""
    return int(next((config_json[k] for k in EXPERT_COUNT_KEYS if config_json.get(k)), 0) or 0)


def configured_router_aux_coef(config_json: dict, override: float | None) -> float | None:
    """``router_aux_loss_coef`` read from a config.json, for checks on the launching host before any weights load."""
    return router_aux_loss_coef(SimpleNamespace(**config_json), override)


def router_aux_loss_coef(config: Any, override: float | None) -> float | None:
    """The coefficient of the router's auxiliary loss in training, or None when the model has no such loss.

    ``override`` is LLaMA-Factory's ``moe_aux_loss_coef`` (it replaces the model's ``router_aux_loss_coef``).
    """
    if not has_router_aux_loss(config):
        return None
    coef = float(config.router_aux_loss_coef if override is None else override)
    return coef or None


def has_router_aux_loss(config: Any) -> bool:
    """Whether the model returns a router auxiliary loss when asked (its config has a coefficient for it)."""
    return hasattr(config, "router_aux_loss_coef") and hasattr(config, "output_router_logits")


def sparse_moe_blocks(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of every module that owns an ``experts`` child and a router child."""
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if EXPERTS_NAME in children and any(r in children for r in ROUTER_NAMES):
            yield name, module


def sparse_moe_block_classes(model: torch.nn.Module) -> list[type[torch.nn.Module]]:
    """The distinct classes of the model's sparse MoE blocks, in model order."""
    found: dict[type[torch.nn.Module], None] = {}
    for _, block in sparse_moe_blocks(model):
        found.setdefault(type(block), None)
    return list(found)


def router_module_names(model: torch.nn.Module) -> set[str]:
    """Full names of the router modules of every sparse block."""
    names: set[str] = set()
    for name, block in sparse_moe_blocks(model):
        children = dict(block.named_children())
        names.update(f"{name}.{r}" for r in ROUTER_NAMES if r in children)
    return names


def fused_expert_parameters(model: torch.nn.Module) -> list[str]:
    """Full names of expert weights stored as 3-D ``[experts, out, in]``-style parameters (not ``nn.Linear``)."""
    names: list[str] = []
    for name, block in sparse_moe_blocks(model):
        experts = dict(block.named_children())[EXPERTS_NAME]
        # ZeRO-3 builds the model partitioned: a parameter's own shape is then empty, its full one is ds_shape.
        names.extend(f"{name}.{EXPERTS_NAME}.{p}" for p, value in experts.named_parameters(recurse=False)
                     if len(getattr(value, "ds_shape", value.shape)) == 3)
    return names


def packed_aux_loss_problem() -> str:
    """Why packed rows cannot train with the router's auxiliary loss (checked before launch and on the ranks)."""
    return ("moe_aux_loss_coef: transformers computes the router aux loss with a 2-D padding mask, and packed rows "
            "give the model a block mask (neat_packing, or one mask per layer type for local/global layers under "
            "sdpa/eager); set neat_packing/packing: false, or moe_aux_loss_coef: 0 to train without the aux loss")


def preference_aux_loss_problem(coef: float, stage: str) -> str:
    return (f"moe_aux_loss_coef ({coef:g}): stage {stage} does not add the router auxiliary loss yet; set "
            "moe_aux_loss_coef: 0 to train this mixture-of-experts model without it")


def fsdp1_fused_lora_problem(weights: str) -> str:
    """LoRA on fused expert weights under FSDP1 (engines/fsdp.py says why it cannot train)."""
    return (f"fsdp_config (fsdp_version: 1) with finetuning_type: lora on fused expert weights ({weights}): "
            "peft adapts them through a parametrization that FSDP1's "
            "flattened parameters do not allow; use fsdp_version: 2 or deepspeed, or a lora_target without the "
            "expert weights (e.g. the attention projections)")


def targets_fused_experts(config_json: dict, lora_target: list[str]) -> bool:
    """Whether LoRA with ``lora_target`` adapts an MoE model's fused expert weights (model/finetuning/targets.py:
    ``all`` includes them; GPT-OSS-style ``gate_up_proj`` exists only fused). A ``down_proj`` that is also a Linear
    elsewhere in the model is decided on the ranks, where the modules are known."""
    return expert_count(config_json) > 1 and bool({"all", "gate_up_proj"} & set(lora_target))


# ---- how the fused experts compute (transformers 5.23's experts_implementation) ----

def experts_implementation(device_type: str, weight_dtype: str) -> tuple[str, str]:
    """The experts implementation for weights of ``weight_dtype`` ("bfloat16", "float32", ...) as the experts see
    them in forward, on ``device_type``, and why.

    transformers 5.23 picks ``grouped_mm`` for every model that allows it, and its ``_grouped_mm`` casts the tokens
    to the weights' dtype before ``torch.nn.functional.grouped_mm``, which autocast does not cover. On CUDA, torch
    2.13 runs that op through its fused CUTLASS kernel only for bf16 operands (SM90/SM100); any other dtype takes
    its fallback, a loop over the experts that copies the group offsets to the host on every call. So with fp32
    weights (DDP or one process with bf16 autocast, and fp32 training) the experts would run unfused and in fp32,
    not in the bf16 that autocast gives every other matmul. ``eager`` (transformers' loop over the experts that
    received tokens, plain matmuls) is then chosen: autocast covers it. bf16 weights (FSDP's mixed precision,
    DeepSpeed's bf16, pure_bf16) keep ``grouped_mm``. On the CPU transformers' own choice stays: torch's grouped_mm
    has a CPU kernel for every dtype there (and the CPU tests compare engines on it).
    """
    if device_type != "cuda":
        return "grouped_mm", "transformers' default (torch's grouped_mm has a CPU kernel for every dtype)"
    if weight_dtype == "bfloat16":
        return "grouped_mm", "bf16 expert weights: torch's fused grouped GEMM"
    return "eager", (f"{weight_dtype} expert weights: torch's grouped_mm fuses bf16 only and autocast does not "
                     "cover it, so the experts run as plain matmuls that autocast covers")


def apply_experts_implementation(model: torch.nn.Module, device_type: str, weight_dtype: str) -> str | None:
    """Set the choice on the model (transformers passes it on to its sub-models); the line that says what the experts
    run, None for a model without fused experts."""
    if not fused_expert_parameters(model):
        return None
    choice, reason = experts_implementation(device_type, weight_dtype)
    outer = next((m for m in model.modules() if hasattr(m, "set_experts_implementation")), None)
    if outer is None:
        return None
    can_switch = getattr(outer, "_can_set_experts_implementation", None)
    if callable(can_switch) and not can_switch():  # Llama 4: its own experts code, which raises when asked
        return "mixture of experts: the model's own experts code (its class cannot switch experts_implementation)"
    outer.set_experts_implementation(choice)  # type: ignore[operator]  # a PreTrainedModel method
    kept = getattr(getattr(outer, "config", None), "_experts_implementation", choice)
    if kept != choice:  # a model class whose experts cannot be switched
        return f"mixture of experts: experts_implementation {kept} (the model's class fixes it)"
    return f"mixture of experts: experts_implementation {choice} ({reason})"


def routing_interface_problem(experts_class: type[torch.nn.Module]) -> str | None:
    """Why expert parallelism cannot drive ``experts_class``: the dispatch needs transformers' fused-experts
    interface, ``forward(hidden_states, top_k_index, top_k_weights)``, to send each routed choice to its rank."""
    params = list(inspect.signature(experts_class.forward).parameters)[1:]
    if len(params) >= 3:
        return None
    return (f"expert_parallel_size: {experts_class.__name__}.forward({', '.join(params)}) takes no routing choices "
            "(the family routes its tokens before its experts), so they cannot be sent to other ranks; set "
            "expert_parallel_size: 1")


def experts_classes(model_type: str) -> list[type[torch.nn.Module]]:
    """The fused-experts classes of transformers' modeling module for ``model_type`` (empty when there is none)."""
    from transformers import CONFIG_MAPPING

    try:  # the config class names the package: llama4_text's is llama4's
        package = CONFIG_MAPPING[model_type].__module__.rsplit(".", 1)[0]
        module = importlib.import_module(f"{package}.modeling_{package.rsplit('.', 1)[-1]}")
    except (KeyError, ImportError):
        return []
    return [value for name, value in vars(module).items()
            if name.endswith("Experts") and isinstance(value, type) and value.__module__ == module.__name__]
