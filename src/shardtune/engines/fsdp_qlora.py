"""FSDP + QLoRA: bitsandbytes 4-bit base weights sharded by FSDP without losing their quantisation state.

The 4-bit weights are loaded with ``bnb_4bit_quant_storage`` equal to the compute dtype (``model/load.py``), so
FSDP sees floating-point parameters it can shard. Five things still go wrong, each handled here:

* **Mixed dtypes.** peft's ``prepare_model_for_kbit_training`` upcasts every weight that is not 4-bit to fp32,
  while the 4-bit weights stay in bf16 storage; FSDP1 refuses a unit whose flat parameter would mix dtypes.
  ``prepare_qlora_for_fsdp`` puts frozen weights back in the compute dtype and keeps trainable (LoRA) weights
  in fp32; ``fsdp1_lora_units`` gives each LoRA layer an FSDP1 unit of its own, as peft's
  ``fsdp_auto_wrap_policy`` does, so fp32 and bf16 never share a flat parameter.
* **Lost quantisation state.** FSDP replaces each ``Params4bit`` by a plain parameter (FSDP2 by a sharded
  DTensor, then a plain unsharded parameter), which has no ``quant_state``. bitsandbytes' ``Linear4bit`` puts it
  back in ``forward`` from ``module.quant_state``; ``prepare_qlora_for_fsdp`` makes sure every 4-bit layer holds
  that copy, and ``layers_missing_quant_state`` checks it after wrapping.
* **Packed bytes read as floats.** FSDP2 all-gathers a unit in its parameters' dtype when they all share one,
  through ``torch._foreach_copy_``, which on CUDA rewrites every bf16 NaN bit pattern into the canonical NaN - and
  packed 4-bit codes often are such patterns (pytorch/pytorch#159333, bitsandbytes-foundation/bitsandbytes#1945).
  A unit whose all-gather inputs have two dtypes is gathered as bytes instead. ``fsdp2_units_unsafe_for_4bit``
  names the units that would copy packed weights as floats; the engine must refuse them. With the dtypes set by
  ``prepare_qlora_for_fsdp`` every decoder layer holds fp32 LoRA weights beside its bf16 4-bit ones, so none is.
* **Checkpoints.** A sharded state dict of a 4-bit model holds bitsandbytes' quantisation-state entries, which
  ``load_state_dict`` then refuses; with ``ignore_frozen_params``, ``drop_quant_state_entries`` leaves the
  trainable weights only (the 4-bit base is reloaded from the model folder on resume).
* **Broadcast from rank 0.** ``model.state_dict()`` of a 4-bit model holds, per layer, a CPU tensor packing the
  quantisation metadata (NCCL cannot send it) and copies that a broadcast would fill in vain;
  ``tensors_to_broadcast`` lists the parameters, buffers and quantisation-state tensors instead.

Loading: ``rank0_first`` lets each node's first rank read (and quantise) the checkpoint while the others wait, so
they then read it from the page cache. Every rank still quantises the whole model on its own GPU before FSDP
shards it: the model must fit one GPU in 4 bits.

Upstream references: Answer.AI's fsdp_qlora and bitsandbytes#970 (quant_storage, LoRA units), transformers#29587
and peft#1550 (FSDP + QLoRA in Trainer), TRL's SFT trainer (no fp32 upcast for sharded QLoRA), accelerate#3983 /
#3987 (FSDP2 and Params4bit).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from shardtune.errors import ModelError

QUANTIZED_PARAMETER_CLASS = "Params4bit"  # bitsandbytes.nn.Params4bit, matched by name: bitsandbytes is optional


def is_4bit(param: torch.Tensor) -> bool:
    return type(param).__name__ == QUANTIZED_PARAMETER_CLASS


def quantized_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every layer whose own ``weight`` is a bitsandbytes 4-bit parameter."""
    found = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None and is_4bit(weight):
            found.append((name, module))
    return found


def prepare_qlora_for_fsdp(model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """Make a 4-bit LoRA model shardable: check the storage dtype, keep the quantisation state, unify dtypes.

    Call on every rank after LoRA is applied and before FSDP wraps the model.
    """
    problems = storage_problems(model, compute_dtype)
    if problems:
        raise ModelError(*problems)
    keep_quant_state_on_layers(model)
    unify_dtypes(model, compute_dtype)


def storage_problems(model: torch.nn.Module, compute_dtype: torch.dtype) -> list[str]:
    """4-bit weights FSDP cannot shard: stored as integers, or in a dtype other than the compute dtype."""
    wrong = [(name, module.weight.dtype) for name, module in quantized_layers(model)
             if module.weight.dtype != compute_dtype]
    if not wrong:
        return []
    name, dtype = wrong[0]
    return [f"quantization_bit (4) with fsdp: {len(wrong)} 4-bit weights (first: {name}) are stored as {dtype}, "
            f"not the compute dtype {compute_dtype}; load them with bnb_4bit_quant_storage={compute_dtype}"]


def keep_quant_state_on_layers(model: torch.nn.Module) -> int:
    """Give every 4-bit layer its own reference to the weight's quantisation state; returns how many layers."""
    layers = quantized_layers(model)
    for name, module in layers:
        state = getattr(module.weight, "quant_state", None)
        if state is None:
            raise ModelError(f"{name}: its 4-bit weight has no quantisation state (it was never quantised); "
                             "load the model with quantization_bit on a CUDA device")
        # bitsandbytes' Linear4bit.forward restores weight.quant_state from here once FSDP swapped the parameter.
        module.quant_state = state
    return len(layers)


def unify_dtypes(model: torch.nn.Module, compute_dtype: torch.dtype) -> dict[str, int]:
    """Frozen floating-point weights in ``compute_dtype``, trainable ones in fp32; 4-bit weights untouched.

    Returns how many parameters each rule changed (``to_compute``, ``to_fp32``).
    """
    changed = {"to_compute": 0, "to_fp32": 0}
    for param in model.parameters():
        if is_4bit(param) or not param.is_floating_point():
            continue
        # Trainable weights keep fp32 for the optimizer's small updates; frozen ones only need the compute dtype.
        target = torch.float32 if param.requires_grad else compute_dtype
        if param.dtype != target:
            param.data = param.data.to(target)
            changed["to_fp32" if param.requires_grad else "to_compute"] += 1
    return changed


def fsdp1_lora_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Leaf modules whose own parameters train (LoRA's A and B): FSDP1 must wrap each as a unit of its own.

    A flat parameter holds one dtype and, for FSDP1, one requires_grad value; these fp32 trainable layers sit
    inside decoder layers whose other weights are frozen and bf16.
    """
    return [module for module in model.modules()
            if not any(True for _ in module.children())
            and any(p.requires_grad for p in module.parameters(recurse=False))]


def fsdp2_units_unsafe_for_4bit(units: Sequence[torch.nn.Module], root: torch.nn.Module,
                                 param_dtype: torch.dtype | None = None) -> list[str]:
    """Names of the FSDP2 units whose all-gather would copy packed 4-bit weights as floating-point values.

    ``units`` in the order ``fully_shard`` is applied (innermost first), then ``root``; each unit manages the
    parameters no earlier unit took. ``param_dtype`` is the MixedPrecisionPolicy's, if any: FSDP2 casts every
    other parameter to it before the all-gather, which can leave the packed weights the only dtype.
    """
    names = {id(module): name or "<root>" for name, module in root.named_modules()}
    taken: set[int] = set()
    found = []
    for unit in [*units, root]:
        own = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        gathered_as = {p.dtype if is_4bit(p) or param_dtype is None else param_dtype for p in own}
        if any(is_4bit(p) for p in own) and len(gathered_as) == 1:
            found.append(names.get(id(unit), type(unit).__name__))
    return found


def layers_missing_quant_state(model: torch.nn.Module) -> list[str]:
    """bitsandbytes 4-bit layers without ``module.quant_state``: check after wrapping (peft's LoRA wrappers of the
    same class name hold no weight of their own and are skipped)."""
    return [name for name, module in model.named_modules()
            if type(module).__module__.startswith("bitsandbytes.")
            and type(module).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4")
            and getattr(module, "quant_state", None) is None]


def tensors_to_broadcast(model: torch.nn.Module) -> list[torch.Tensor]:
    """What rank 0 must send so every rank starts identical: parameters, buffers and 4-bit quantisation state."""
    tensors: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        tensors.setdefault(id(tensor), tensor)
    for _, module in quantized_layers(model):
        weight: Any = module.weight  # a bitsandbytes Params4bit (untyped), which carries quant_state
        for tensor in quant_state_tensors(weight.quant_state):
            tensors.setdefault(id(tensor), tensor)
    return list(tensors.values())


def quant_state_tensors(state: object) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes QuantState (absmax, code, offset) and of its nested state, if any."""
    found = []
    for owner in (state, getattr(state, "state2", None)):
        for field in ("absmax", "code", "offset"):
            value = getattr(owner, field, None)
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


# What bitsandbytes' Linear4bit.state_dict() adds after "<layer>.weight.": the QuantState's tensors and the packed
# metadata ("quant_state.bitsandbytes__nf4").
_QUANT_STATE_ENTRY = re.compile(r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|offset|quant_state\..+)$")


def drop_quant_state_entries(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` without bitsandbytes' quantisation-state entries.

    For resumable checkpoints of a QLoRA model: the 4-bit base is reloaded (and quantised) from the model folder,
    so a checkpoint needs only the trainable weights - take the state with
    ``StateDictOptions(ignore_frozen_params=True)``, which drops the frozen parameters but not these entries, and
    load it back with ``strict=False`` (the frozen entries are then missing by design; DCP still fails on a missing
    trainable one). FSDP1 otherwise saves them and its ``load_state_dict`` refuses them as unexpected keys.
    """
    return {key: value for key, value in state_dict.items() if not _QUANT_STATE_ENTRY.search(key)}


@contextlib.contextmanager
def rank0_first(is_first: bool, barrier: Callable[[], None]) -> Iterator[None]:
    """Run the body on the first rank of each node, then on the others.

    ``is_first`` is true on each node's local rank 0. Every rank calls ``barrier`` once: the first ranks after the
    body, the others before it, so the others start only when every first rank has finished.
    """
    if not is_first:
        barrier()
    try:
        yield
    finally:
        if is_first:
            barrier()
