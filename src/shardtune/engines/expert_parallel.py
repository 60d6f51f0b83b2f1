"""Expert parallelism under FSDP2: each rank holds ``1/ep`` of every MoE layer's experts and the tokens travel.

The world is seen as a 2-D mesh ``(edp, ep)``: ``ep`` consecutive ranks split a layer's experts between them
(rank ``i`` of an ``ep`` group holds experts ``[i*E/ep, (i+1)*E/ep)``), and the ``edp`` groups hold the same
experts, which FSDP2 shards between them. Dense weights stay sharded over every rank, as without expert
parallelism, so the global batch and the data order do not change.

A routed forward sends each (token, choice) to the rank that holds the chosen expert: the counts first, then the
rows, with an all-to-all whose backward is the reverse all-to-all. The receiving rank runs the family's own expert
function (transformers' fused experts, eager loop or grouped matmul as the model is configured) on its local slice
of the weights, sends the results back, and the routing weights combine them in fp32.

Exactness: a rank's experts receive the gradient of every token sent to them by the ``ep`` ranks of their group;
FSDP2 sums it over the ``edp`` group and divides by the world size, which is what dense weights get (their
gradients are averaged over all ranks, and the loop multiplies each rank's loss by the world size). The gradient
norm sums both meshes' squares. A rank that receives no rows still enters every collective, forward and backward
(its expert weights get a zero gradient instead of none), so no rank waits for another.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from shardtune.engines.expert_adapters import hand_adapters_to_dispatch, unwrap_adapters, with_local_adapters
from shardtune.errors import ModelError
from shardtune.model.moe import EXPERTS_NAME, routing_interface_problem, sparse_moe_blocks

MESH_DIMS = ("edp", "ep")


@dataclass
class ExpertTraffic:
    """Bytes this rank sent through the experts' all-to-alls (rows out and results back, forward only)."""

    bytes_sent: int = 0
    rows_received: int = 0  # (token, choice) rows this rank's experts computed

    def add(self, rows: torch.Tensor) -> None:
        self.bytes_sent += rows.numel() * rows.element_size()


@dataclass
class ExpertPlacement:
    """Which experts this rank holds, per MoE layer, and the traffic their dispatch caused."""

    mesh: DeviceMesh
    experts_per_rank: int
    held: dict[str, list[int]] = field(default_factory=dict)  # experts module name -> expert indices held here
    traffic: ExpertTraffic = field(default_factory=ExpertTraffic)

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("ep")

    def report(self) -> dict[str, Any]:
        """This rank's part: the experts it holds (the same indices in every MoE layer) and the bytes it sent."""
        return {"experts_held": next(iter(self.held.values()), []), "all_to_all_bytes": self.traffic.bytes_sent,
                "rows_received": self.traffic.rows_received}

    def summary(self, per_rank: list[dict[str, Any]], steps: int) -> dict[str, Any]:
        """train_results.json's ``expert_parallel``: the mesh and, per rank, what it held and sent per step."""
        return {"size": self.mesh.size(1), "expert_data_parallel_size": self.mesh.size(0),
                "experts_per_rank": self.experts_per_rank, "moe_layers": len(self.held),
                "ranks": [{"experts_held": r["experts_held"],
                           "all_to_all_bytes_per_step": round(r["all_to_all_bytes"] / max(steps, 1)),
                           "rows_received_per_step": round(r["rows_received"] / max(steps, 1))}
                          for r in per_rank]}


def build_expert_mesh(device_type: str, world_size: int, expert_parallel: int) -> DeviceMesh:
    """``(edp, ep)``: an ``ep`` group is ``expert_parallel`` consecutive ranks (inside a node when it fits)."""
    return init_device_mesh(device_type, (world_size // expert_parallel, expert_parallel), mesh_dim_names=MESH_DIMS)


def place_experts(model: torch.nn.Module, mesh: DeviceMesh) -> ExpertPlacement:
    """Keep this rank's slice of every MoE layer's experts (as a DTensor sharded on the ``ep`` mesh dimension, so
    checkpoints and exports see the whole expert dimension) and route the experts' forward through the dispatch."""
    ep_mesh = mesh["ep"]
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    placement: ExpertPlacement | None = None
    for name, block in sparse_moe_blocks(model):
        experts, adapters = unwrap_adapters(getattr(block, EXPERTS_NAME))
        hand_adapters_to_dispatch(adapters)
        problem = routing_interface_problem(type(experts))
        if problem:
            raise ModelError(problem)
        total = int(experts.num_experts)
        per_rank = total // ep
        first = ep_rank * per_rank
        for pname, param in list(experts.named_parameters(recurse=False)):
            if param.dim() and param.shape[0] == total:
                local = param.detach()[first:first + per_rank]
                local = local if local.is_meta else local.clone()
                spread = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape,
                                            stride=param.stride())
                setattr(experts, pname, torch.nn.Parameter(spread, requires_grad=param.requires_grad))
        placement = placement or ExpertPlacement(mesh, per_rank)
        placement.held[f"{name}.{EXPERTS_NAME}"] = list(range(first, first + per_rank))
        experts.forward = types.MethodType(_dispatching_forward(type(experts).forward, total, per_rank, placement,
                                                                adapters, first), experts)
    if placement is None:
        raise ValueError("expert parallelism: the model has no sparse MoE block (experts with a router)")
    return placement


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every MoE layer's experts module (under peft's wrappers where LoRA adapts its fused weights: the wrappers and
    their adapters stay with the dense weights, engines/expert_adapters.py)."""
    return [unwrap_adapters(getattr(block, EXPERTS_NAME))[0] for _, block in sparse_moe_blocks(model)]


def shard_experts(model: torch.nn.Module, mesh: DeviceMesh, world_size: int, **fsdp_kwargs: Any) -> None:
    """FSDP2 over the ``edp`` ranks for each experts module, sharding the dimension after the experts'. The
    gradient is summed over ``edp`` and divided by the world size: what the dense weights get (see module doc)."""
    from torch.distributed.fsdp import fully_shard

    for module in expert_modules(model):
        experts = fully_shard(module, mesh=mesh["edp"], shard_placement_fn=lambda _p: Shard(1), **fsdp_kwargs)
        experts.set_gradient_divide_factor(float(world_size))
        # gloo has no pre-multiplied sum: scale, then sum. Not on a one-rank edp group: there torch 2.13 divides
        # by the factor without any collective and then once more as the forced sum's post-division.
        if mesh["edp"].size() > 1 and dist.get_backend(mesh["edp"].get_group()) == "gloo":
            experts.set_force_sum_reduction_for_comms(True)


def _dispatching_forward(family_forward: Callable[..., torch.Tensor], total: int, per_rank: int,
                         placement: ExpertPlacement, adapters: list[Any], first: int
                         ) -> Callable[..., torch.Tensor]:
    def forward(self: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen // per_rank, stable=True)  # grouped by the rank that holds the expert
        send_counts = torch.bincount(chosen // per_rank, minlength=total // per_rank)
        group = placement.ep_group
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        sends, receives = send_counts.tolist(), recv_counts.tolist()
        rows = hidden[order // k]
        received = _all_to_all(rows, receives, sends, group)
        local_ids = torch.empty(sum(receives), dtype=chosen.dtype, device=chosen.device)
        dist.all_to_all_single(local_ids, (chosen % per_rank)[order].contiguous(), receives, sends, group=group)
        weights = with_local_adapters(_local_weights(self), adapters, first, per_rank)
        computed = _run_local_experts(self, family_forward, received, local_ids, per_rank, weights)
        returned = _all_to_all(computed, sends, receives, group)
        placement.traffic.add(rows)
        placement.traffic.add(computed)
        placement.traffic.rows_received += received.shape[0]
        per_choice = returned[torch.argsort(order)].view(tokens, k, -1)
        combined = (per_choice.float() * top_k_weights.float().unsqueeze(-1)).sum(dim=1)
        return combined.to(hidden.dtype)

    return forward


def _all_to_all(rows: torch.Tensor, out_counts: list[int], in_counts: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    """Rows to the ranks of ``group`` (``in_counts[i]`` to rank i), ``out_counts[i]`` back from each; autograd's
    backward is the reverse exchange."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), out_counts, in_counts, group))


def _run_local_experts(experts: torch.nn.Module, family_forward: Callable[..., torch.Tensor], rows: torch.Tensor,
                       local_ids: torch.Tensor, per_rank: int, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The family's expert function on this rank's slice (``weights``: its local tensors, LoRA's local delta added
    where it adapts them), weight 1 per row."""
    local = _local_view(experts, per_rank, weights)
    ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    out = family_forward(local, rows, local_ids.unsqueeze(1), ones)
    if rows.shape[0] == 0:
        # Nothing arrived: keep the rows and this rank's expert weights (and adapters) in the graph, so that the
        # backward all-to-alls run here too and every rank reduces a gradient (zero) for the same weights.
        out = out + 0.0 * sum(w.sum() for w in weights.values()) + 0.0 * rows.sum()
    return out


def _local_weights(experts: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The experts' parameters as this rank's local tensors (autograd flows back to the DTensors)."""
    return {name: _as_local(p) for name, p in experts._parameters.items() if p is not None}


def _local_view(experts: torch.nn.Module, per_rank: int, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A shallow copy of the experts module whose parameters are ``weights`` and whose expert count is the local
    one."""
    view = object.__new__(type(experts))
    view.__dict__.update(experts.__dict__)
    view.__dict__.pop("forward", None)
    # Plain tensors where parameters were: nn.Module reads _parameters by name.
    view.__dict__["_parameters"] = dict(weights)
    view.__dict__["num_experts"] = per_rank
    return view


def _as_local(value: torch.Tensor | None) -> torch.Tensor:
    assert value is not None
    return value.to_local() if isinstance(value, DTensor) else value


def clip_grad_norm_by_mesh(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over weights that live on different meshes (dense: all ranks; experts: edp x ep).
    Every element of every gradient is held by exactly one rank (FULL_SHARD or SHARD_GRAD_OP, the only strategies
    allowed with expert parallelism), so the squares of the local shards summed over the world are the norm's
    square: one all-reduce, whatever the meshes."""
    params = [p for p in parameters if p.grad is not None]
    local = [_as_local(p.grad).float() for p in params]
    square = torch.stack([n ** 2 for n in torch._foreach_norm(local)]).sum() if local else torch.zeros(())
    dist.all_reduce(square)
    total = square.sqrt()
    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:  # DTensor arithmetic refuses to mix meshes in one call
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
