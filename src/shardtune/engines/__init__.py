"""Engines behind one interface; ``build_engine`` constructs the one the launch plan chose."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig
    from shardtune.engines.base import Engine
    from shardtune.engines.plan import EnginePlan
    from shardtune.world import RankEnv


def build_engine(config: TrainConfig, plan: EnginePlan, rank_env: RankEnv | None) -> Engine:
    """Local engine in one plain process; otherwise join the launcher's process group first."""
    import torch

    from shardtune.engines.base import PrecisionSettings

    # pure_bf16: the weights are bf16 themselves, so no autocast on top (LLaMA-Factory's meaning).
    precision = PrecisionSettings(bf16=config.bf16 and not config.pure_bf16, fp16=config.fp16)
    if rank_env is None:
        from shardtune.engines.local import LocalEngine

        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return LocalEngine(precision, device)
    from shardtune.engines.distributed import init_distributed

    ctx = init_distributed(rank_env, config.ddp_timeout)
    if plan.kind == "deepspeed":
        from shardtune.engines.deepspeed import DeepSpeedEngine
        from shardtune.engines.deepspeed_config import deepspeed_inputs, resolve_deepspeed_config
        from shardtune.world import WorldLayout

        layout = WorldLayout.of_ranks(ctx.world_size, ctx.local_world_size, config.per_device_train_batch_size,
                                      config.gradient_accumulation_steps)
        resolved = resolve_deepspeed_config(plan.deepspeed_raw or {}, deepspeed_inputs(config, layout))
        return DeepSpeedEngine(resolved, precision, ctx)
    if plan.kind == "fsdp" and plan.fsdp is not None:
        from shardtune.engines.fsdp import FSDPEngine

        return FSDPEngine(plan.fsdp, precision, ctx)
    from shardtune.engines.ddp import DDPEngine

    return DDPEngine(precision, ctx, find_unused_parameters=bool(config.ddp_find_unused_parameters))
