"""The config keys that decide what trains, as the fine-tuning setup reads them (train/settings.py builds them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardtune.config.adapter_method import target_key
from shardtune.model.finetuning.oft import OftSettings


@dataclass(frozen=True)
class FrozenParts:
    """LLaMA-Factory's freeze_* keys for image-text models (ignored by text models; parts: model/composite.py)."""

    vision_tower: bool = True
    multi_modal_projector: bool = True
    language_model: bool = False

    def freezes(self, part: str) -> bool:
        """Whether the part ``ModelParts.part_of`` names ('tower', 'projector' or 'language') stays frozen."""
        return {"tower": self.vision_tower, "projector": self.multi_modal_projector,
                "language": self.language_model}[part]


@dataclass(frozen=True)
class FinetuningSettings:
    """The subset of the config that decides trainable parameters."""

    finetuning_type: str = "lora"
    lora_rank: int = 8
    lora_alpha: int | None = None
    lora_dropout: float = 0.0
    lora_target: tuple[str, ...] = ("all",)  # the adapter's targets: lora_target, or oft_target under OFT
    oft: OftSettings = OftSettings()
    freeze_trainable_layers: int = 2
    freeze_trainable_modules: tuple[str, ...] = ("all",)
    llama_pro: bool = False  # use_llama_pro: only the expanded blocks train (freeze) or get adapters (lora)
    gradient_checkpointing: bool = False
    checkpointing_kwargs: dict[str, Any] = field(default_factory=dict)  # torch.utils.checkpoint arguments
    is_quantized: bool = False
    resume_adapter: str | None = None  # a saved adapter that trains on (its own rank, alpha and targets)
    use_dora: bool = False
    use_rslora: bool = False
    pissa_init: bool = False
    pissa_iter: int = 16
    additional_target: tuple[str, ...] | None = None
    neftune_noise_alpha: float | None = None
    sequence_parallel: int = 1  # ranks sharing each row: the embedding sees 1/N of it, NEFTune's length is the row's
    train_embeddings: bool = False  # resize_vocab: LoRA trains and saves the embedding and output layer in full
    score_head: bool = False  # stage rm (set by ModelSource): the score layer trains in full under freeze and LoRA too
    frozen_parts: FrozenParts = FrozenParts()  # image-text models: the freeze_* keys

    @property
    def target_key(self) -> str:
        """The key that named the adapter's targets, for messages."""
        return target_key(self.finetuning_type)

    @property
    def init_lora_weights(self) -> bool | str:
        """peft's spelling of the initialisation: PiSSA with fast SVD (``pissa_niter_N``) or exact, else LoRA's."""
        if not self.pissa_init:
            return True
        return "pissa" if self.pissa_iter == -1 else f"pissa_niter_{self.pissa_iter}"


def checkpointing_kwargs(settings: FinetuningSettings) -> dict[str, Any]:
    """torch.utils.checkpoint's arguments: non-reentrant unless gradient_checkpointing_kwargs says otherwise."""
    return {"use_reentrant": False, **settings.checkpointing_kwargs}
