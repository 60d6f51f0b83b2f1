"""LoRA on the fused expert weights under expert parallelism: each rank applies its own experts' slice of the
adapters.

peft adapts a fused expert weight (``[experts, in, out]``, LoRA's ``target_parameters``) with a ``ParamWrapper``
around the experts module: on every forward it registers a parametrization that adds the delta of all experts,
``scaling x B @ A`` per expert, to the weight. Under expert parallelism the weight is a DTensor of which a rank holds
``per_rank`` experts, so the whole delta cannot be added to it. Instead the wrappers' own activation is switched off
and the dispatch (engines/expert_parallel.py) adds, to the local weights it hands the family's expert function, the
delta of the local experts only, computed from their rows of A and columns of B as peft computes the whole.

The adapters themselves stay whole on every rank, sharded like dense weights over all ranks (they are a small share
of the experts' bytes): a rank's backward gives a gradient to its experts' rows and columns only, and the reduction
over all ranks, divided by the world size as for every dense weight, sums the contributions of every rank that holds
each expert, which is the gradient one process computes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def unwrap_adapters(slot: Any) -> tuple[Any, list[Any]]:
    """The experts module under peft's ``ParamWrapper``s (LoRA on its fused weights; outermost first), and them."""
    wrappers = []
    while hasattr(slot, "parameter_name") and hasattr(slot, "lora_A") and hasattr(slot, "base_layer"):
        wrappers.append(slot)
        slot = slot.base_layer
    return slot, wrappers


def hand_adapters_to_dispatch(wrappers: list[Any]) -> None:
    """Switch off each wrapper's parametrization of the (split) weight: the dispatch applies the local slice."""
    for wrapper in wrappers:
        wrapper._activate_lora = _applied_by_dispatch  # the instance's, not peft's class method


def _applied_by_dispatch(_adapters: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def with_local_adapters(weights: dict[str, torch.Tensor], wrappers: list[Any], first: int,
                        count: int) -> dict[str, torch.Tensor]:
    """``weights`` (the local experts' tensors by parameter name) plus, for each adapted one, its LoRA delta for
    experts ``[first, first + count)``."""
    adapted = dict(weights)
    for wrapper in wrappers:
        delta = local_delta(wrapper, first, count)
        if delta is not None:
            name = wrapper.parameter_name
            adapted[name] = adapted[name] + delta.to(adapted[name].dtype)
    return adapted


def local_delta(wrapper: Any, first: int, count: int) -> torch.Tensor | None:
    """peft's ``ParamWrapper.get_delta_weight`` (summed over the active adapters) for experts ``[first, first +
    count)`` only: A is ``[experts x rank, in]`` expert-major, B ``[out, rank x experts]`` expert-minor."""
    if wrapper.disable_adapters or wrapper.merged:
        return None
    total = wrapper.num_experts
    equation = "o r e, e r i -> e o i" if wrapper._did_swap_in_out_features else "o r e, e r i -> e i o"
    delta = None
    for adapter in wrapper.active_adapters:
        if adapter not in wrapper.lora_A:
            continue
        a = wrapper.lora_A[adapter].weight
        b = wrapper.lora_B[adapter].weight
        a = a.reshape(total, -1, a.shape[-1])[first:first + count]
        b = b.reshape(b.shape[0], -1, total)[:, :, first:first + count]
        part = torch.einsum(equation, b, a) * wrapper.scaling[adapter]
        delta = part if delta is None else delta + part
    return delta
