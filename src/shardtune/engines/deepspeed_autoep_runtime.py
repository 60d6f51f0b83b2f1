"""DeepSpeed's AutoEP on the ranks (the config and its refusals: deepspeed_autoep.py).

``deepspeed.initialize`` replaces every MoE block with an ``AutoEPMoELayer`` holding ``E / autoep_size`` experts as
``w1``/``w3``/``w2`` (gate, up, down) and its own router. What shardtune adds around it:

- transformers 5.23's output-capture registry takes one argument in ``get`` and keys ``__setitem__`` by the
  value's class; DeepSpeed 0.19.8's AutoEP calls ``get(key, default)`` and restores entries by their string key
  (``TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given``). For the length of
  ``initialize`` both also take the string key DeepSpeed passes.
- ZeRO-1/2 need the experts in their own optimizer groups (``moe: True``), built after the replacement.
- The saved model: the experts gathered over each expert-parallel group and written back under the family's
  Hugging Face names and layout, so it loads in transformers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardtune.model.moe import EXPERTS_NAME, sparse_moe_blocks

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@contextlib.contextmanager
def registry_accepts_string_keys() -> Iterator[None]:
    """transformers' ``_CanRecordRegistry`` as the plain dict DeepSpeed's AutoEP expects, while it runs."""
    from transformers.utils import output_capturing

    registry = output_capturing._CanRecordRegistry
    get, setitem = registry.get, registry.__setitem__

    def get_by_key(self: Any, key: Any, *default: Any) -> Any:
        return dict.get(self, key, *default) if isinstance(key, str) else get(self, key)

    def set_by_key(self: Any, key: Any, value: Any) -> None:
        dict.__setitem__(self, key, value) if isinstance(key, str) else setitem(self, key, value)

    registry.get, registry.__setitem__ = get_by_key, set_by_key  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        registry.get, registry.__setitem__ = get, setitem  # type: ignore[method-assign]


def moe_grouped_optimizer(build: OptimizerFactory) -> Callable[[Any], torch.optim.Optimizer]:
    """A callable DeepSpeed calls with the parameters after the replacement: our optimizer, its groups split so the
    experts (reduced over their expert-data-parallel group) sit in groups of their own."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    def build_split(params: Any) -> torch.optim.Optimizer:
        optimizer = build(list(params))
        for i, group in enumerate(optimizer.param_groups):
            group.setdefault("name", f"group{i}")
        optimizer.param_groups[:] = split_params_into_different_moe_groups_for_optimizer(optimizer.param_groups)
        return optimizer

    return build_split


@dataclass
class HfBlockNames:
    """One Hugging Face MoE block as it was before AutoEP replaced it: its state-dict keys (relative), the names of
    the children AutoEP keeps (shared experts, their gate) by identity, and the fused expert weights' shapes."""

    keys: set[str]
    kept_children: dict[int, str] = field(default_factory=dict)
    down_proj_shape: tuple[int, ...] = ()


def record_hf_blocks(model: torch.nn.Module) -> dict[str, HfBlockNames]:
    """Before ``initialize``: every sparse MoE block's Hugging Face names, by the block's module name."""
    found = {}
    for name, block in sparse_moe_blocks(model):
        experts = getattr(block, EXPERTS_NAME)
        kept = {id(child): child_name for child_name, child in block.named_children()
                if child is not experts and child_name not in ("gate", "router")}
        down = getattr(experts, "down_proj", None)
        # A model built partitioned (ZeRO-3's zero.Init) has empty local tensors: its full shape is ds_shape.
        shape = tuple(getattr(down, "ds_shape", down.shape)) if isinstance(down, torch.Tensor) else ()
        found[name] = HfBlockNames(set(block.state_dict().keys()), kept, shape)
    return found


def autoep_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Every ``AutoEPMoELayer`` (DeepSpeed's, untyped) by its module name."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, AutoEPMoELayer)]


def _gathered(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole expert dimension from the ranks of ``group`` (rank i of it holds the i-th slice)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts)


def hf_block_state(layer: Any, names: HfBlockNames) -> dict[str, torch.Tensor]:
    """A collective over the layer's expert-parallel group: the block's tensors under its Hugging Face names."""
    w1, w2, w3 = (_gathered(getattr(layer.experts, w), layer.ep_group) for w in ("w1", "w2", "w3"))
    experts = EXPERTS_NAME
    if names.down_proj_shape[1:] == tuple(w2.shape[1:]):  # transformers' [E, 2*ffn, hidden] / [E, hidden, ffn]
        state = {f"{experts}.gate_up_proj": torch.cat([w1, w3], dim=1), f"{experts}.down_proj": w2}
    else:  # the transposed fused layout
        state = {f"{experts}.gate_up_proj": torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous(),
                 f"{experts}.down_proj": w2.transpose(1, 2).contiguous()}
    for key, value in layer.router.state_dict().items():
        if key.startswith("gate."):
            state[key] = value
        elif f"gate.{key}" in names.keys:  # DeepSeek-V3's e_score_correction_bias
            state[f"gate.{key}"] = value
    for attribute in ("shared_experts", "shared_experts_gate"):
        child = getattr(layer, attribute, None)
        if child is not None:
            hf_name = names.kept_children[id(child)]
            state.update({f"{hf_name}.{k}": v for k, v in child.state_dict().items()})
    if state.keys() != names.keys:
        raise RuntimeError(f"AutoEP export: the block's names {sorted(state)} are not transformers' "
                           f"{sorted(names.keys)}")
    return state


def hf_state_dict(model: torch.nn.Module, blocks: dict[str, HfBlockNames], is_main: bool, zero3: bool = False
                  ) -> dict[str, torch.Tensor] | None:
    """Every rank calls (the experts are gathered); rank 0 gets the model's state dict under transformers' names,
    the others None. ``zero3``: every weight is partitioned too, and is gathered module by module first."""
    if zero3:
        return zero3_hf_state_dict(model, blocks, is_main)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()} if is_main else {}
    for name, layer in autoep_layers(model):
        block = hf_block_state(layer, blocks[name])
        if is_main:
            for key in [k for k in state if k.startswith(f"{name}.")]:
                del state[key]
            state.update({f"{name}.{k}": v.detach().clone() for k, v in block.items()})
    return state if is_main else None


def zero3_hf_state_dict(model: torch.nn.Module, blocks: dict[str, HfBlockNames], is_main: bool
                        ) -> dict[str, torch.Tensor] | None:
    """``hf_state_dict`` under ZeRO-3, where DeepSpeed's own consolidation refuses AutoEP's experts: each module's
    own weights gathered (an AutoEP layer's all at once, then its experts over the expert-parallel group), copied on
    rank 0 before they are partitioned again, one module at a time (the peak is one module, not the model)."""
    import deepspeed

    layers = dict(autoep_layers(model))
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if any(name.startswith(f"{layer}.") for layer in layers):
            continue  # gathered with its AutoEP layer
        whole = name in layers
        params = list(module.parameters()) if whole else [p for _, p in module.named_parameters(
            recurse=False, remove_duplicate=False)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            own = hf_block_state(module, blocks[name]) if whole else own_tensors(module)
            if is_main:
                state.update({f"{name}.{key}" if name else key: value.detach().clone() for key, value in own.items()})
    return state if is_main else None


def own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's own parameters (tied ones under each name, as state_dict gives them) and persistent buffers."""
    found: dict[str, torch.Tensor] = dict(module.named_parameters(recurse=False, remove_duplicate=False))
    found.update({name: b for name, b in module.named_buffers(recurse=False, remove_duplicate=False)
                  if name not in module._non_persistent_buffers_set})
    return found


@dataclass
class AutoEPTraffic:
    """Rows this rank's local experts computed (AutoEP pads each expert's rows to an alignment)."""

    rows: int = 0

    def hook(self, _module: torch.nn.Module, args: tuple, _output: Any) -> None:
        self.rows += int(args[1].sum())


def count_expert_rows(model: torch.nn.Module) -> AutoEPTraffic:
    traffic = AutoEPTraffic()
    for _, layer in autoep_layers(model):
        layer.experts.register_forward_hook(traffic.hook)
    return traffic


def rank_report(model: torch.nn.Module, traffic: AutoEPTraffic) -> dict[str, Any]:
    """This rank's part of train_results.json's ``expert_parallel``: the experts it holds (the same in every layer)."""
    layers = autoep_layers(model)
    _, first = layers[0]
    start = first.ep_rank * first.num_local_experts
    return {"size": first.ep_size, "experts_per_rank": first.num_local_experts, "moe_layers": len(layers),
            "experts_held": list(range(start, start + first.num_local_experts)), "rows": traffic.rows}


def summary(per_rank: list[dict[str, Any]], steps: int, world_size: int) -> dict[str, Any]:
    first = per_rank[0]
    return {"size": first["size"], "expert_data_parallel_size": world_size // first["size"],
            "experts_per_rank": first["experts_per_rank"], "moe_layers": first["moe_layers"], "via": "deepspeed-autoep",
            "ranks": [{"experts_held": r["experts_held"], "rows_received_per_step": round(r["rows"] / max(steps, 1))}
                      for r in per_rank]}
