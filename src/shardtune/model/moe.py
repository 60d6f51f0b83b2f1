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

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the callers that pass models in; this module stays light to import
    import torch

# Attributes of a sparse block that hold the router (Qwen3-MoE/Mixtral/DeepSeek-V3: gate; GPT-OSS: router).
ROUTER_NAMES = ("gate", "router")
EXPERTS_NAME = "experts"


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
