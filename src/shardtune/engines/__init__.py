"""Engines behind one interface; ``build_engine`` constructs the one the launch plan chose."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig
    from shardtune.engines.base import Engine
    from shardtune.engines.engine_plan import EnginePlan
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
    import dataclasses
    import importlib

    from shardtune.engines.distributed import init_distributed
    from shardtune.engines.plan import spec_for

    module, name = spec_for(plan.kind).engine.split(":")
    engine_class = getattr(importlib.import_module(module), name)
    engine = engine_class.from_plan(config, plan, init_distributed(rank_env, config.ddp_timeout), precision)
    if config.sequence_parallel_size > 1:
        from shardtune.engines.sequence_parallel import join_sequence_groups
        from shardtune.world import WorldLayout

        layout = WorldLayout.of_ranks(engine.world_size, rank_env.local_world_size)
        layout = dataclasses.replace(layout, sequence_parallel=config.sequence_parallel_size)
        engine.sequence = join_sequence_groups(layout, engine.rank, config.sequence_parallel_mode)
    return engine
