"""Layer-wise GaLore and APOLLO (``galore_layerwise``/``apollo_layerwise``): one optimizer per weight, stepped
inside the backward as soon as that weight's gradient is complete, which then frees it.

So at most one weight's gradient (with the activations' own) is alive at a time instead of the whole model's: the
memory a full fine-tune spends on gradients shrinks to the largest weight's. LLaMA-Factory's rules come with it
(launch/validate.py and the engine records refuse what cannot hold): one process, no gradient accumulation (the
step happens in every backward), no fp16 loss scaling (the hooks would step on scaled gradients); and, as in the HF
Trainer there, max_grad_norm is not applied (no global norm exists before the weights have stepped), so the logged
grad_norm is 0.

Each weight's optimizer gets the group settings the whole optimizer would give it (optim/replacements.py), and
APOLLO's random projection the seed the whole optimizer would use for it (its position among all weights), so a
layer-wise run takes the same steps as the plain one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from shardtune.optim.replacements import ChainedOptimizer

OptimizerOfGroups = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


class LayerwiseOptimizer(ChainedOptimizer):
    """Per-weight optimizers stepped from gradient hooks; ``step`` and ``zero_grad`` have nothing left to do.

    As a ChainedOptimizer it shows the children's group dicts as its own ``param_groups``, so the run's one
    learning-rate scheduler sets every child's rate after each step, and its state dict keeps each child's state
    (moments, projectors) apart for resume."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        super().__init__(optimizers)
        self.handles: list[RemovableHandle] = []
        for optimizer in optimizers:
            (param,) = [p for group in optimizer.param_groups for p in group["params"]]
            self.handles.append(param.register_post_accumulate_grad_hook(_stepper(optimizer)))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        # The hooks stepped every weight during backward; a closure would need a second backward to do it again.
        assert closure is None, "layer-wise optimizers step inside backward"
        return None

    def remove_hooks(self) -> None:
        """Detach the hooks (an optimizer built again over the same weights would otherwise step them twice)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _stepper(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    def step_and_free(param: torch.Tensor) -> None:
        if param.grad is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step_and_free


def build_layerwise(groups: list[dict[str, Any]], build: OptimizerOfGroups,
                    seed_key: str | None = None) -> LayerwiseOptimizer:
    """One optimizer per weight of ``groups`` (each with its group's settings), built by ``build`` from a one-group
    list. ``seed_key``: the per-weight state entry holding the whole optimizer's 1-based weight index (APOLLO's
    random-projection seed), set to what the whole optimizer would have given."""
    optimizers = []
    index = 0
    for group in groups:
        for param in group["params"]:
            index += 1
            optimizer = build([{**group, "params": [param]}])
            if seed_key is not None and seed_key in optimizer.state[param]:
                optimizer.state[param][seed_key] = index
            optimizers.append(optimizer)
    return LayerwiseOptimizer(optimizers)
