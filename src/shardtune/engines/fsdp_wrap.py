"""Which submodules of a model get their own FSDP unit (FSDP2 and FSDP1 alike): the decoder layers by class, or
by size; the rest stays in the root's unit."""

from __future__ import annotations

import torch

from shardtune.engines.engine_plan import FsdpSettings


def wrap_targets(model: torch.nn.Module, s: FsdpSettings) -> list[torch.nn.Module]:
    """Submodules that get their own FSDP unit, innermost first."""
    if s.auto_wrap_policy == "NO_WRAP":
        return []
    if s.auto_wrap_policy == "SIZE_BASED_WRAP":
        return _size_based_targets(model, s.min_num_params)
    names = set(s.transformer_layer_cls_to_wrap or layer_class_names(model))
    targets = [m for m in model.modules() if type(m).__name__ in names]
    # A unit holding a weight tied to one outside it (BERT's word embeddings, the output layer's weight) cannot be
    # sharded on its own: FSDP refuses a parameter in two units. It stays in its parent's unit with the other copy.
    shared = parameters_tied_outside(model, targets)
    # Innermost first: a unit nested in another (Falcon-Mamba's mixer in its block, both no-split classes) must be
    # sharded before the one around it, whose sharding would otherwise turn the inner unit's weights into DTensors.
    depth = {id(module): name.count(".") for name, module in model.named_modules()}
    return sorted((m for m in targets if id(m) not in shared), key=lambda m: -depth[id(m)])


def layer_class_names(model: torch.nn.Module) -> list[str]:
    """The decoder-layer class from the model's ``_no_split_modules`` (as HF and accelerate do); for a model that
    declares none (BioGPT, Blenderbot), the class of its layer stack: the longest ModuleList of one class."""
    get_base_model = getattr(model, "get_base_model", None)  # peft's wrapper: the class list is on its base
    base = get_base_model() if get_base_model is not None else model
    names = list(getattr(base, "_no_split_modules", None) or [])
    stacks = [m for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m) and
              len({type(layer) for layer in m}) == 1]
    if not names and stacks:
        names = [type(max(stacks, key=len)[0]).__name__]
    if not names:
        raise ValueError("fsdp_config: cannot find the model's layer class; set fsdp_transformer_layer_cls_to_wrap")
    return names


def parameters_tied_outside(model: torch.nn.Module, modules: list[torch.nn.Module]) -> set[int]:
    """ids of the ``modules`` holding a parameter that a module outside them holds too (a tied weight)."""
    holders: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), set()).add(name)
    prefixes = {id(module): name + "." for name, module in model.named_modules()}
    found = set()
    for module in modules:
        prefix = prefixes[id(module)]
        if any(not other.startswith(prefix) for param in module.parameters() for other in holders[id(param)]):
            found.add(id(module))
    return found


def _size_based_targets(model: torch.nn.Module, min_num_params: int) -> list[torch.nn.Module]:
    chosen: list[torch.nn.Module] = []
    covered: set[int] = set()
    for module in reversed(list(model.modules())):  # children before parents
        if module is model or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue  # containers have no forward for FSDP to hook
        size = sum(p.numel() for p in module.parameters() if id(p) not in covered)
        if size >= min_num_params:
            chosen.append(module)
            covered.update(id(p) for p in module.parameters())
    return chosen
