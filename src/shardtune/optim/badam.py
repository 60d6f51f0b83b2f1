"""BAdam (LLaMA-Factory's ``use_badam`` with ``badam_mode: layer``): block coordinate descent with AdamW, through the
badam package's ``BlockOptimizer``, built as LLaMA-Factory builds it.

The package splits the model into one block per decoder layer (``...layers.N.``); embeddings, the output head and
the final norm stay frozen. One block is trainable at a time (``requires_grad``), with an fp32 copy of its weights
that the AdamW steps and copies back; after ``badam_switch_interval`` steps the next block takes over and the Adam
moments start afresh. So a step needs gradients and optimizer state for one layer only (with ``pure_bf16`` the
model itself stays in bfloat16, which is where BAdam saves memory). The package's own schedule is kept: the first
switch comes after ``interval - 1`` steps (it tests ``(steps + 1) % interval`` after counting the step), then one
every ``interval`` steps; every active weight, biases and norms too, gets ``weight_decay``.

What shardtune adds (``ResumableBlockOptimizer``), since the package saves only the AdamW state:

* ``state_dict`` also holds the schedule (steps taken, the active and next block, the random order and its
  generator), the learning rates the scheduler set and the active block's fp32 copies, so a resumed run takes the
  steps the uninterrupted one takes. The engine's checkpoint holds every weight the optimizer holds, not only the
  active block's (engines/torch_native.py).
* ``badam_switch_mode: random`` draws its permutations from a generator seeded with ``seed`` rather than the global
  random state the package uses: the order is the seed's, and the run's dropout and data draws stay unchanged.
* ``badam_switch_interval: -1`` (LLaMA-Factory: never switch) is the package's ``fixed`` mode: the package itself
  would switch at every step, since ``n % -1 == 0``. ``fixed`` with no start block starts at block 0 (the package
  would fail), and ``badam_verbose`` decides what a switch prints (the package prints the prefixes at every switch).

Where it runs is decided before launch (launch/optimizer_checks.py, engines/spec.py): one process, full fine-tuning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from badam import BlockOptimizer

from shardtune.errors import ConfigError
from shardtune.optim.settings import BlockSwitching, OptimizerSettings

NEVER = 2**62  # steps per block for badam_switch_interval -1


class ResumableBlockOptimizer(BlockOptimizer):
    """The package's BlockOptimizer with its whole position in ``state_dict`` and a seeded random order."""

    def __init__(self, base_optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]],
                 blocks: BlockSwitching) -> None:
        # The package's own inference (no embedding, no output head), made here to know the blocks before it starts.
        prefixes = BlockOptimizer.infer_param_groups(self, [name for name, _ in named], False, False)
        if not prefixes:
            raise ConfigError("use_badam (true): no trainable parameter name holds 'layers.N.', so BAdam finds no "
                              "decoder layers to train block by block; use finetuning_type: full on a decoder model")
        self.order_generator = torch.Generator().manual_seed(blocks.seed)
        self.block_order: list[int] = []
        mode = "fixed" if blocks.switch_interval == -1 else blocks.switch_mode
        start = self._first_block(blocks.start_block, mode, len(prefixes))
        self.active_block_idx = start
        with warnings.catch_warnings():
            # The package warns about fp32 weights, naming every parameter; shardtune's run log says the dtype.
            warnings.filterwarnings("ignore", message="BAdam expect model to be loaded")
            super().__init__(base_optimizer=base_optimizer, named_parameters_list=named, block_prefix_list=prefixes,
                             switch_block_every=_steps_per_block(blocks), start_block=start, switch_mode=mode,
                             verbose=blocks.verbose)
        # The package binds the base optimizer's state_dict on the instance (for the HF Trainer); ours holds more.
        del self.state_dict

    def _first_block(self, start: int | None, mode: str, count: int) -> int:
        if start is not None:
            if start >= count:
                raise ConfigError(f"badam_start_block ({start}): the model has {count} blocks (0 to {count - 1})")
            return start
        if mode == "random":
            self.block_order = self._permutation(count)
            return self.block_order.pop()
        return count - 1 if mode == "descending" else 0

    def _permutation(self, count: int) -> list[int]:
        return torch.randperm(count, generator=self.order_generator).tolist()

    def _update_active_block_idx(self) -> None:
        if self.switch_mode != "random":
            super()._update_active_block_idx()
            return
        if not self.block_order:
            self.block_order = self._permutation(self.block_num)
        self.current_block_idx = self.block_order.pop()

    def switch_trainable_params(self, verbose: int | None = None) -> None:
        # The package calls this with its default verbosity 1 at every switch; badam_verbose decides instead.
        self.active_block_idx = self.current_block_idx
        super().switch_trainable_params(self.verbose)

    @property
    def fp32_weights(self) -> list[torch.Tensor]:
        """The fp32 copies the AdamW steps for the active block, in parameter order."""
        return list(self.param_idx2hp.values())

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"base": self.base_optimizer.state_dict(), "global_step": self.global_step,
                "active_block": self.active_block_idx, "next_block": self.current_block_idx,
                "block_order": list(self.block_order), "order_generator": self.order_generator.get_state(),
                "lr": [group["lr"] for group in self.param_groups], "fp32_weights": self.fp32_weights}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the saved block active again (fp32 copies from the weights, which the engine loaded first), then
        put back the schedule, the copies and the AdamW state."""
        self.current_block_idx = int(state_dict["active_block"])
        self.switch_trainable_params()
        self.global_step = int(state_dict["global_step"])
        self.current_block_idx = int(state_dict["next_block"])
        self.block_order = [int(i) for i in state_dict["block_order"]]
        self.order_generator.set_state(state_dict["order_generator"].cpu())
        for group, lr in zip(self.param_groups, state_dict["lr"], strict=True):
            group["lr"] = lr
        with torch.no_grad():
            for copy, saved in zip(self.fp32_weights, state_dict["fp32_weights"], strict=True):
                copy.copy_(saved)
        self.base_optimizer.load_state_dict(state_dict["base"])


def _steps_per_block(blocks: BlockSwitching) -> int:
    # The package also switches (fresh moments, fresh fp32 copies) in fixed mode: never, for -1.
    return NEVER if blocks.switch_interval == -1 else blocks.switch_interval


def build_badam(named: list[tuple[str, torch.nn.Parameter]], s: OptimizerSettings) -> ResumableBlockOptimizer:
    """BAdam over the model's ``named`` parameters (all trainable at call: full fine-tuning), its AdamW from
    ``optim`` (adamw_torch or adamw_torch_fused, checked before launch)."""
    params = [p for _, p in named]
    base = torch.optim.AdamW(params, lr=s.learning_rate, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_epsilon,
                             weight_decay=s.weight_decay, fused=s.optim == "adamw_torch_fused")
    return ResumableBlockOptimizer(base, named, s.extra.blocks)
