"""ASFT's anchor (``use_asft_loss``): the frozen reference's next-token distribution at every trainable position.

ASFT (Anchored Supervised Fine-Tuning, arXiv:2509.23753; LLaMA-Factory's ``asft_loss_func``) is DFT plus
``asft_alpha`` times each trainable token's ``KL(reference || policy)`` over the whole vocabulary, the reference
being the model as training started. The loss itself is in train/loss.py (``Anchor``); here the reference scores
each micro-batch first, without gradients, with the same inputs as the policy (packed rows, images and a
sequence-parallel slice included: LLaMA-Factory passes only the ids and mask). The reference is the one dpo/kto use
(``live_reference``): the policy with its adapters off (LoRA, OFT), or a frozen copy the engine places as it places
the policy, a replica under DDP and ZeRO-0/1/2, sharded under ZeRO-3 and FSDP; ``ref_model`` replaces it.

The reference's logits are taken whole (a ``[rows, positions, vocab]`` tensor in the compute dtype, as LLaMA-
Factory's ``ref_logits``), and its distribution is kept in fp32 for the trainable positions only: one
``[trainable tokens, vocab]`` tensor per micro-batch, which the chunked loss reads a chunk at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtune.engines.base import Engine
from shardtune.model.source import ModelSource
from shardtune.train.loop import IGNORE_INDEX, MODEL_INPUTS, Batch, targets_of
from shardtune.train.loss import Anchor
from shardtune.train.preference_step import Reference, live_reference


@dataclass
class AnchorReference:
    """The reference of an ASFT run and ``alpha``; ``anchor`` scores one micro-batch."""

    reference: Reference
    alpha: float

    def anchor(self, engine: Engine, batch: Batch) -> Anchor:
        """The reference's distribution at ``batch``'s trainable positions, rows in the order the loss keeps them
        (row-major over the shifted labels)."""
        inputs = {k: v for k, v in batch.items() if k in MODEL_INPUTS}
        logits = self.reference.logits(engine, inputs)
        if "shift_labels" not in batch:  # a sequence-parallel slice's labels are already each position's next
            logits = logits[:, :-1]
        kept = logits[targets_of(batch) != IGNORE_INDEX]
        return Anchor(kept.to(torch.promote_types(kept.dtype, torch.float32)).softmax(dim=-1), self.alpha)


def build_anchor(engine: Engine, source: ModelSource, finetuning_type: str, alpha: float,
                 separate: bool = False) -> AnchorReference:
    """ASFT's reference loaded from ``source`` (``reference_source``: the policy's own, or ``ref_model`` when
    ``separate``) and placed by ``engine``."""
    return AnchorReference(live_reference(engine, source, finetuning_type, separate), alpha)
