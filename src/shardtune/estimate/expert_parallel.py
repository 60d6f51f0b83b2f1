"""What expert parallelism (``expert_parallel_size`` E > 1, FSDP2 only) changes in the memory model: the one owner
of its rule, read by the FSDP terms (estimate/options.py), the activations and the report.

engines/expert_parallel.py splits each MoE layer's experts over an ``ep`` group of E ranks and FSDP2 shards each
rank's E_total/E experts over the W/E ranks that hold the same ones (the expert-data-parallel group). So:

* the *sharded* states per rank are those without E: every expert weight, gradient and optimizer state is still
  spread over all W ranks (E_total/E experts / (W/E) ranks = E_total/W of a layer's experts per rank);
* what shrinks is the *gathered* working set: FSDP2 unshards a layer's E_total/E local experts, not all E_total,
  in forward and backward (and their unreduced gradients are E times smaller);
* the dispatch adds, one MoE layer at a time, the rows it sends and receives (tokens x top-k x hidden, out and
  back) and their gradients in the backward; and the combine keeps each choice's returned row in fp32 for the
  backward (``per_choice.float() * weights``), where without E the family's own function adds in place.

Pure: no torch; symbols in README.md here ("Expert parallelism").
"""

from __future__ import annotations

from shardtune.estimate.hardware import GiB
from shardtune.estimate.shape import ModelShape
from shardtune.estimate.workload import Workload
from shardtune.world import WorldLayout

FP32 = 4
# A dispatched row exists four times around one MoE layer's experts: sent, received, computed and returned (the
# backward's gradients of the same four replace them): tokens x top-k x hidden each, in the experts' dtype.
DISPATCH_COPIES = 4


def splits_experts(shape: ModelShape, w: Workload) -> bool:
    """Whether the run splits experts over ranks (a mixture of experts with expert_parallel_size > 1)."""
    return shape.moe is not None and w.expert_parallel > 1


def local_experts(shape: ModelShape, w: Workload) -> int:
    """Experts of each MoE layer one rank holds (and FSDP2 gathers): E_total / E (all without expert parallelism)."""
    if shape.moe is None:
        return 0
    return shape.moe.experts // w.expert_parallel if splits_experts(shape, w) else shape.moe.experts


def layer_routed_expert_params(shape: ModelShape, index: int, experts: int) -> int:
    """Fused expert weights of ``experts`` experts of layer ``index`` (no router: it stays with the dense weights)."""
    if not shape.is_moe_layer(index):
        return 0
    assert shape.moe is not None
    return experts * shape.moe.expert_params(shape.hidden_size)


def gathered_layer_params(shape: ModelShape, w: Workload) -> int:
    """Parameters of the largest decoder layer as FSDP2 gathers it: the whole layer, or under expert parallelism its
    dense part (attention, norms, router, shared experts) and this rank's E_total/E experts."""
    if not splits_experts(shape, w):
        return shape.layer_params
    assert shape.moe is not None
    away = shape.moe.experts - local_experts(shape, w)
    return max(shape.layer_param_count(i) - layer_routed_expert_params(shape, i, away)
               for i in range(shape.num_layers))


def gathered_expert_params(shape: ModelShape, w: Workload) -> int:
    """Routed expert parameters of the largest MoE layer that one gather holds: E_total/E experts' (E_total
    without expert parallelism); 0 for a dense model."""
    experts = local_experts(shape, w)
    return max((layer_routed_expert_params(shape, i, experts) for i in range(shape.num_layers)), default=0)


def away_expert_params(shape: ModelShape, w: Workload) -> int:
    """Routed expert parameters of every layer that live on other ranks' experts (0 without expert parallelism)."""
    if not splits_experts(shape, w):
        return 0
    assert shape.moe is not None
    away = shape.moe.experts - local_experts(shape, w)
    return sum(layer_routed_expert_params(shape, i, away) for i in range(shape.num_layers))


def held_share(shape: ModelShape, w: Workload) -> float:
    """The share of the decoder's weights a rank gathers when it gathers every layer (SHARD_GRAD_OP after the
    forward): all, or all but the other ranks' experts."""
    decoder = shape.layers_params(range(shape.num_layers))
    return (decoder - away_expert_params(shape, w)) / decoder if decoder else 1.0


def held_trainable(shape: ModelShape, w: Workload, trainable: int) -> int:
    """Trainable parameters whose gradients a rank holds unsharded (SHARD_GRAD_OP accumulating): all, or under
    full fine-tuning all but the other ranks' experts (adapters leave the experts frozen; freeze tuning is
    counted whole, an upper bound)."""
    return trainable - away_expert_params(shape, w) if w.finetuning_type == "full" else trainable


def combine_bytes_per_token(shape: ModelShape, w: Workload, index: int) -> int:
    """What layer ``index``'s combine keeps per token for the backward under expert parallelism: every choice's
    returned row in fp32 (top-k x hidden x 4)."""
    if not splits_experts(shape, w) or not shape.is_moe_layer(index):
        return 0
    assert shape.moe is not None
    return shape.moe.top_k * shape.hidden_size * FP32


def dispatch_bytes(shape: ModelShape, w: Workload, expert_bytes: int) -> int:
    """The all-to-all buffers of one MoE layer (transient, one layer at a time): the rows sent and received, the
    results computed and returned, each tokens x top-k x hidden in the experts' dtype (``expert_bytes``: fp32
    under FSDP2, whose weights are fp32), and in the backward their gradients in their place. An even router is
    assumed: a rank receives as many rows as it sends."""
    if not splits_experts(shape, w):
        return 0
    assert shape.moe is not None
    return DISPATCH_COPIES * w.tokens * shape.moe.top_k * shape.hidden_size * expert_bytes


def expert_parallel_problems(shape: ModelShape, w: Workload, nodes: int, ranks_per_node: int) -> list[str]:
    """Why the estimate cannot split this model's experts over ``expert_parallel_size`` ranks of this world (the
    world's own checks, and a model without experts)."""
    if w.expert_parallel == 1:
        return []
    key = f"expert_parallel_size ({w.expert_parallel})"
    if shape.moe is None:
        return [f"{key}: {shape.source or shape.model_type} has no mixture-of-experts layers; set "
                "expert_parallel_size: 1"]
    layout = WorldLayout(nodes, ranks_per_node, expert_parallel=w.expert_parallel)
    return layout.expert_parallel_problems(shape.moe.experts)


def expert_parallel_dict(shape: ModelShape, w: Workload, nodes: int, ranks_per_node: int) -> dict[str, int] | None:
    """The JSON report's ``expert_parallel``: the mesh, experts per rank and the bytes the split changes (fp32)."""
    if not splits_experts(shape, w):
        return None
    layout = WorldLayout(nodes, ranks_per_node, expert_parallel=w.expert_parallel)
    return {"size": w.expert_parallel, "expert_data_parallel_size": layout.expert_data_parallel_size,
            "experts_per_rank": local_experts(shape, w),
            "gathered_expert_bytes_per_layer": FP32 * gathered_expert_params(shape, w),
            "gathered_expert_bytes_per_layer_without": FP32 * gathered_expert_params(shape, Workload(1, 1)),
            "dispatch_bytes": dispatch_bytes(shape, w, FP32)}


def describe_expert_parallel(shape: ModelShape, w: Workload, nodes: int, ranks_per_node: int) -> list[str]:
    """The report's line: the mesh, experts per rank and what one gather of a layer's experts holds (fp32)."""
    if not splits_experts(shape, w):
        return []
    assert shape.moe is not None
    layout = WorldLayout(nodes, ranks_per_node, expert_parallel=w.expert_parallel)
    whole = gathered_expert_params(shape, Workload(1, 1))
    local = gathered_expert_params(shape, w)
    return [f"expert parallel: mesh (expert-data-parallel {layout.expert_data_parallel_size} x expert-parallel "
            f"{w.expert_parallel}), {local_experts(shape, w)} of {shape.moe.experts} experts per layer on each rank "
            f"(FSDP2 only); a gathered layer holds {local / 1e6:.4g}M expert parameters instead of "
            f"{whole / 1e6:.4g}M ({FP32 * local / GiB:.2f} instead of {FP32 * whole / GiB:.2f} GiB in fp32); "
            f"dispatch buffers {dispatch_bytes(shape, w, FP32) / GiB:.2f} GiB per MoE layer"]
