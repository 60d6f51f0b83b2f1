"""Config -> the explicit settings each component takes. Import-light: `shardtune check` uses it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtune.config.adapter_method import adapter_targets
from shardtune.config.schema import TrainConfig
from shardtune.data.settings import DataSettings, resolved_packing
from shardtune.model.finetuning.oft import OftSettings
from shardtune.model.finetuning.settings import FinetuningSettings, FrozenParts
from shardtune.model.pretrained_adapters import AdapterPlan, plan_adapters

if TYPE_CHECKING:
    from shardtune.train.loss import TokenWeighting


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
        excess_length_strategy=c.excess_length_strategy,
        neat_packing=c.neat_packing,
        preprocessing_batch_size=c.preprocessing_batch_size,
        streaming=c.streaming,
        buffer_size=c.buffer_size,
        model_dir=c.model_name_or_path or "",
        image_max_pixels=c.image_max_pixels,
        image_min_pixels=c.image_min_pixels,
    )


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
        lora_target=tuple(adapter_targets(c)[1]),
        oft=OftSettings(c.oft_rank, c.oft_block_size, c.module_dropout),
        freeze_trainable_layers=c.freeze_trainable_layers,
        freeze_trainable_modules=tuple(c.freeze_trainable_modules),
        llama_pro=c.use_llama_pro,
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
        sequence_parallel=c.sequence_parallel_size,
        train_embeddings=c.resize_vocab,
        frozen_parts=FrozenParts(c.freeze_vision_tower, c.freeze_multi_modal_projector, c.freeze_language_model),
    )


def token_weighting(c: TrainConfig) -> TokenWeighting | None:
    """LLaMA-Factory's DFT and EAFT losses (train/loss.py), and ASFT's, which weighs its tokens as DFT (its KL term:
    train/anchor.py); eval_loss stays the plain cross entropy."""
    from shardtune.train.loss import TokenWeighting  # torch: not for the launching host's checks

    if c.use_dft_loss or c.use_asft_loss:
        return TokenWeighting("dft")
    return TokenWeighting("eaft", c.eaft_alpha) if c.use_eaft_loss else None


def adapter_plan(c: TrainConfig) -> AdapterPlan:
    return plan_adapters(tuple(c.adapter_name_or_path), c.create_new_adapter)
