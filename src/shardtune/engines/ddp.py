"""PyTorch DistributedDataParallel: the default engine when more than one process runs."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from shardtune.engines.base import PrecisionSettings
from shardtune.engines.distributed import DistContext, DistributedMixin
from shardtune.engines.torch_native import TorchEngine
from shardtune.versions import ddp_no_forward_buffer_sync

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig
    from shardtune.engines.engine_plan import EnginePlan
    from shardtune.model.source import ModelSource


class DDPEngine(DistributedMixin, TorchEngine):
    name = "ddp"

    @classmethod
    def from_plan(cls, config: TrainConfig, plan: EnginePlan, ctx: DistContext,
                  precision: PrecisionSettings) -> DDPEngine:
        return cls(precision, ctx, find_unused_parameters=bool(config.ddp_find_unused_parameters))

    def __init__(self, precision: PrecisionSettings, ctx: DistContext, find_unused_parameters: bool = False) -> None:
        super().__init__(precision, ctx.device)
        self.ctx = ctx
        self.find_unused_parameters = find_unused_parameters
        self.image_model = ""  # the data has images: the model folder, whose processor the probe step reads

    def build_model(self, source: ModelSource) -> torch.nn.Module:
        self.image_model = source.name_or_path if source.reads_images else ""
        return super().build_model(source)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DistributedDataParallel, set for a causal LM:

        * Frozen (LoRA base) parameters are not registered for reduction, so LoRA needs no unused-parameter
          search; it stays off unless asked for, as it costs a graph walk per step.
        * ``gradient_as_bucket_view``: the gradients are views into the all-reduce buckets, so they are not copied
          into them and back after every backward, and the buckets are not a second copy of the gradients.
        * ``forward_sync_buffers`` off: by default DDP broadcasts every buffer from rank 0 before each forward (one
          more collective per micro-batch). A causal LM's buffers (rotary frequencies, masks) are constants the
          model computes the same on every rank, and none is trained; so nothing changes by skipping it.
        * ``static_graph`` stays off: with gradient accumulation (``no_sync`` on all micro-batches but the last)
          torch 2.13's reducer fails an internal assertion under it (seen with ddp_find_unused_parameters on 2
          ranks; the ``ddp-find_unused`` cell of tests/distributed/test_engines_cli.py covers that combination).
        """
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        if not self.find_unused_parameters:
            self.find_unused_parameters = self._freeze_unreached(model)
        no_buffer_sync = ddp_no_forward_buffer_sync(DistributedDataParallel)
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=self.find_unused_parameters,
                                       gradient_as_bucket_view=True, **no_buffer_sync)

    def _freeze_unreached(self, model: torch.nn.Module) -> bool:
        """Freeze the parameters the LM loss never reaches (model/gradient_probe.py): DDP then waits for none of
        them. True when some expert weight got none in the probe: routing may reach it later, so DDP searches
        for unused parameters instead (its cost per step is the price of not hanging)."""
        from shardtune.data.images import blank_image_inputs
        from shardtune.model.gradient_probe import ProbeFailed, is_expert_parameter, parameters_without_gradient

        image = blank_image_inputs(self.image_model) if self.image_model else None
        try:
            unreached = parameters_without_gradient(model, self.device, image)
        except ProbeFailed as failure:  # unknown which parameters get a gradient: let DDP search, never hang
            if self.ctx.rank == 0:
                print(f"[shardtune] ddp: the probe forward that finds parameters without a gradient failed "
                      f"({failure}); ddp_find_unused_parameters is turned on", flush=True)
            return True
        experts = [name for name in unreached if is_expert_parameter(name)]
        frozen = [name for name in unreached if not is_expert_parameter(name)]
        parameters = dict(model.named_parameters())
        for name in frozen:
            parameters[name].requires_grad_(False)
        if self.ctx.rank == 0 and frozen:
            print(f"[shardtune] ddp: {len(frozen)} parameters get no gradient from the language-model loss and are "
                  f"frozen (the optimizer would never move them; DDP would wait for them), e.g. {frozen[0]}",
                  flush=True)
        if self.ctx.rank == 0 and experts:
            print(f"[shardtune] ddp: {len(experts)} expert weights got no gradient in a probe step (e.g. "
                  f"{experts[0]}); ddp_find_unused_parameters is turned on", flush=True)
        return bool(experts)

    def accumulation_context(self, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if is_last_micro_batch else self.wrapped().no_sync()

    def unwrapped_model(self) -> torch.nn.Module:
        return self.wrapped().module

    def wrapped(self) -> DistributedDataParallel:
        """The prepared model as the DistributedDataParallel it must be."""
        if not isinstance(self.model, DistributedDataParallel):
            raise RuntimeError(f"engine ddp: model is {type(self.model).__name__}, not DistributedDataParallel")
        return self.model

    def verify(self) -> None:
        import torch.distributed as dist

        self.wrapped()  # raises unless the model is DistributedDataParallel
        if dist.get_world_size() != self.ctx.world_size:
            raise RuntimeError(f"engine ddp: world size {dist.get_world_size()} != expected {self.ctx.world_size}")
