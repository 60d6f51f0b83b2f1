"""What the optimizer is asked to be: the settings the config maps to, used by train (which builds it) and by the
DeepSpeed engine (which fills its JSON optimizer section from them)."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.schema import TrainConfig


@dataclass(frozen=True)
class BlockSwitching:
    """BAdam's block schedule (optim/badam.py): which block first, in what order, how many steps each."""

    start_block: int | None = None
    switch_mode: str = "ascending"
    switch_interval: int = 50  # -1: never switch
    verbose: int = 0
    seed: int = 42  # draws badam_switch_mode: random's permutations


@dataclass(frozen=True)
class ExtraOptimizer:
    """Which LLaMA-Factory optimizer replacement is on, with its GaLore/APOLLO projection settings."""

    kind: str | None = None  # "muon", "galore", "apollo", "adam_mini", "badam" or None (plain optim)
    target: tuple[str, ...] = ("all",)
    rank: int = 16
    update_interval: int = 200
    scale: float = 2.0
    proj_type: str = "std"
    apollo_proj: str = "random"
    apollo_scale_type: str = "channel"
    apollo_scale_front: bool = False
    layerwise: bool = False  # GaLore/APOLLO: one optimizer per weight, stepped from its gradient hook
    blocks: BlockSwitching = BlockSwitching()  # BAdam


@dataclass(frozen=True)
class OptimizerSettings:
    optim: str = "adamw_torch_fused"
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    loraplus_lr_ratio: float | None = None
    loraplus_lr_embedding: float = 1e-6
    extra: ExtraOptimizer = ExtraOptimizer()


def optimizer_settings(c: TrainConfig) -> OptimizerSettings:
    return OptimizerSettings(optim=c.optim, learning_rate=c.learning_rate, weight_decay=c.weight_decay,
                             adam_beta1=c.adam_beta1, adam_beta2=c.adam_beta2, adam_epsilon=c.adam_epsilon,
                             loraplus_lr_ratio=c.loraplus_lr_ratio, loraplus_lr_embedding=c.loraplus_lr_embedding,
                             extra=extra_optimizer(c))


def extra_optimizer(c: TrainConfig) -> ExtraOptimizer:
    """LLaMA-Factory's replacement switches; validation allows at most one of them on."""
    if c.use_galore:
        return ExtraOptimizer("galore", tuple(c.galore_target), c.galore_rank, c.galore_update_interval,
                              c.galore_scale, c.galore_proj_type, layerwise=c.galore_layerwise)
    if c.use_apollo:
        return ExtraOptimizer("apollo", tuple(c.apollo_target), c.apollo_rank, c.apollo_update_interval,
                              c.apollo_scale, c.apollo_proj_type, c.apollo_proj, c.apollo_scale_type,
                              c.apollo_scale_front, layerwise=c.apollo_layerwise)
    if c.use_adam_mini:
        return ExtraOptimizer("adam_mini")
    if c.use_muon:
        return ExtraOptimizer("muon")
    if c.use_badam:
        return ExtraOptimizer("badam", blocks=BlockSwitching(c.badam_start_block, c.badam_switch_mode,
                                                             c.badam_switch_interval, c.badam_verbose, c.seed))
    return ExtraOptimizer()


def layerwise_key(c: TrainConfig) -> str | None:
    """The layer-wise switch in force: galore_layerwise/apollo_layerwise count only with their optimizer on (off,
    they are inert, as in LLaMA-Factory)."""
    if c.use_galore and c.galore_layerwise:
        return "galore_layerwise"
    if c.use_apollo and c.apollo_layerwise:
        return "apollo_layerwise"
    return None
