"""Config -> the explicit settings each component takes. Import-light: `shardtune check` uses it."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.schema import TrainConfig
from shardtune.data.settings import DataSettings
from shardtune.model.adapters import FinetuningSettings
from shardtune.model.pretrained_adapters import AdapterPlan, plan_adapters


def data_settings(c: TrainConfig) -> DataSettings:
    return DataSettings(
        dataset=tuple(c.dataset),
        dataset_dir=c.dataset_dir,
        template=c.template,
        default_system=c.default_system,
        enable_thinking=c.enable_thinking,
        tool_format=c.tool_format,
        stage=c.stage,
        cutoff_len=c.cutoff_len,
        max_samples=c.max_samples,
        val_size=c.val_size,
        packing=resolved_packing(c),
        train_on_prompt=c.train_on_prompt,
        seed=c.seed,
        preprocessing_num_workers=c.preprocessing_num_workers,
        overwrite_cache=c.overwrite_cache,
        eval_dataset=tuple(c.eval_dataset),
        mix_strategy=c.mix_strategy,
        interleave_probs=tuple(as_probability(p) for p in c.interleave_probs),
        mask_history=c.mask_history,
        neat_packing=c.neat_packing,
        preprocessing_batch_size=c.preprocessing_batch_size,
        streaming=c.streaming,
        buffer_size=c.buffer_size,
    )


def resolved_packing(c: TrainConfig) -> bool:
    """neat_packing turns packing on: shardtune's sft packing always keeps samples apart."""
    if c.neat_packing:
        return True
    return c.packing if c.packing is not None else c.stage == "pt"


def as_probability(text: str) -> float:
    """A number, or NaN, which the data checks report with the key's values."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def finetuning_settings(c: TrainConfig) -> FinetuningSettings:
    return FinetuningSettings(
        finetuning_type=c.finetuning_type,
        lora_rank=c.lora_rank,
        lora_alpha=c.lora_alpha,
        lora_dropout=c.lora_dropout,
        lora_target=tuple(c.lora_target),
        freeze_trainable_layers=c.freeze_trainable_layers,
        freeze_trainable_modules=tuple(c.freeze_trainable_modules),
        gradient_checkpointing=c.gradient_checkpointing,
        checkpointing_kwargs=dict(c.gradient_checkpointing_kwargs or {}),
        is_quantized=c.quantization_bit is not None,
        resume_adapter=adapter_plan(c).to_resume,
        use_dora=c.use_dora,
        use_rslora=c.use_rslora,
        pissa_init=c.pissa_init,
        pissa_iter=c.pissa_iter,
        additional_target=tuple(c.additional_target) if c.additional_target else None,
        neftune_noise_alpha=c.neftune_noise_alpha,
        train_embeddings=c.resize_vocab,
    )


def adapter_plan(c: TrainConfig) -> AdapterPlan:
    return plan_adapters(tuple(c.adapter_name_or_path), c.create_new_adapter)


@dataclass(frozen=True)
class ExtraOptimizer:
    """Which LLaMA-Factory optimizer replacement is on, with its GaLore/APOLLO projection settings."""

    kind: str | None = None  # "muon", "galore", "apollo", "adam_mini" or None (plain optim)
    target: tuple[str, ...] = ("all",)
    rank: int = 16
    update_interval: int = 200
    scale: float = 2.0
    proj_type: str = "std"
    apollo_proj: str = "random"
    apollo_scale_type: str = "channel"
    apollo_scale_front: bool = False


@dataclass(frozen=True)
class OptimizerSettings:
    optim: str = "adamw_torch"
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
                              c.galore_scale, c.galore_proj_type)
    if c.use_apollo:
        return ExtraOptimizer("apollo", tuple(c.apollo_target), c.apollo_rank, c.apollo_update_interval,
                              c.apollo_scale, c.apollo_proj_type, c.apollo_proj, c.apollo_scale_type,
                              c.apollo_scale_front)
    if c.use_adam_mini:
        return ExtraOptimizer("adam_mini")
    if c.use_muon:
        return ExtraOptimizer("muon")
    return ExtraOptimizer()
