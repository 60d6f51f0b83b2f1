"""Muon over FSDP2's sharded weights: each matrix's update orthogonalised whole, applied shard by shard.

FSDP2 gives every rank a DTensor shard (rows of dim 0) of each weight and of its gradient. Muon's momentum and
Nesterov mix are element-wise, so they run on the shards as they are; the Newton-Schulz orthogonalisation is not (it
multiplies the whole matrix by its transpose), so each rank gathers the mixed update (``DTensor.full_tensor``, one
all-gather the size of the weight, as FSDP2's own forward moves), orthogonalises it with torch's own function, and
applies only its own rows. Every rank computes the same whole update from the same gathered bits, so the result is
the one-process update, bit for bit up to the gradient's reduction order.

Why every rank orthogonalises every matrix, rather than each rank a share of them followed by a broadcast: the
gather-everywhere form needs one collective per matrix and no bookkeeping of owners; the spread form saves
(world_size - 1) / world_size of the Newton-Schulz work (about 30 matmuls of the matrix's size per step, small beside
the forward and backward of a fine-tuning step at these batch sizes) for a gather to the owner and a scatter back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon whose parameters may be DTensors sharded by FSDP2 (plain tensors step as torch's Muon).

    The momentum buffer is a shard like the weight (``zeros_like`` of the DTensor gradient), so the optimizer
    state stays sharded and FSDP2's distributed checkpoint saves and reshards it as any other."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            for param, grad, buffer in zip(params, grads, buffers, strict=True):
                _step_matrix(param, grad, buffer, group)
        return loss


def _step_matrix(param: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor, group: dict) -> None:
    """torch's single-tensor Muon step for one matrix, the orthogonalisation on the gathered whole."""
    momentum = group["momentum"]
    buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
    whole = update.full_tensor() if isinstance(update, DTensor) else update
    ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
    lr = float(group["lr"])
    # param.shape is the whole matrix's for a DTensor too: the learning-rate rule sees the true shape.
    adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)
    target = param.to_local() if isinstance(param, DTensor) else param
    if isinstance(param, DTensor):
        # This rank's rows, cut locally as FSDP2 cut the weight (src_data_rank=None: no communication).
        ortho = distribute_tensor(ortho, param.device_mesh, param.placements, src_data_rank=None).to_local()
    target.mul_(1 - lr * group["weight_decay"])
    target.add_(ortho, alpha=-adjusted_lr)
