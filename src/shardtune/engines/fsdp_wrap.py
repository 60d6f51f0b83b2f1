"""Which submodules of a model get their own FSDP unit (FSDP2 and FSDP1 alike): the decoder layers by class, or
by size; the rest stays in the root's unit. FSDP2's ``fully_shard`` of those units (and, under expert parallelism,
of the experts first) is here too."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardtune.engines.engine_plan import FsdpSettings
from shardtune.engines.expert_parallel import shard_experts
from shardtune.engines.fsdp_config import reshards_after_forward
from shardtune.engines.fsdp_qlora import fsdp2_units_unsafe_for_4bit
from shardtune.errors import ModelError


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


def shard_fsdp2(model: torch.nn.Module, s: FsdpSettings, mesh: DeviceMesh, device: torch.device,
                compute_dtype: torch.dtype | None = None, expert_mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """``fully_shard`` each wrap unit, then the root; meta parameters stay meta (filled afterwards). Under
    expert parallelism the experts modules are units of their own first, on the expert mesh."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # Pinned memory needs an accelerator; on a CPU-only machine offload without pinning.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if s.offload_params else OffloadPolicy()
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype \
        else MixedPrecisionPolicy()
    reshard = reshards_after_forward(s.sharding_strategy)  # hybrid strategies also get a 2-D mesh (build_mesh)
    if expert_mesh is not None:
        shard_experts(model, expert_mesh, mesh.size(), reshard_after_forward=reshard, offload_policy=offload,
                      mp_policy=precision)
    units = wrap_targets(model, s)
    unsafe = fsdp2_units_unsafe_for_4bit(units, model, compute_dtype)
    if unsafe:
        raise ModelError(f"fsdp: units {', '.join(unsafe)} hold only 4-bit weights, which FSDP2 would gather as "
                         "floating-point values; wrap LoRA layers with them or use fsdp_version: 1")
    sharded = [fully_shard(module, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload,
                           mp_policy=precision) for module in units]
    # The root unit (embeddings, final norm, output layer) is the first the backward needs, right after the forward:
    # freeing it after the forward would only gather it again at once (as torchtitan, it stays gathered).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=offload, mp_policy=precision)
    if s.backward_prefetch == "NO_PREFETCH":
        # One unit gathered at a time in backward: less memory, no overlap of gathering and compute.
        for unit in sharded:
            unit.set_modules_to_backward_prefetch([])
    if s.forward_prefetch:
        # FSDP2 prefetches one unit ahead in backward by itself; forward prefetch is explicit.
        for current, following in zip(sharded, sharded[1:], strict=False):
            current.set_modules_to_forward_prefetch([following])
    return model
