"""stage rm: the pairwise reward objective. The model is the causal LM's body under a one-label score head
(model/reward_head.py, built by the model source before fine-tuning is applied, so full, freeze and LoRA runs and
every engine place it as any other model).

The loss is -log sigmoid(r_chosen - r_rejected) per pair (train/preference.py), averaged over all pairs of the
window across ranks like the other preference stages.

Under sequence parallelism each rank runs its slice of every row, and the head's own pooling (the rightmost token
that is not padding, within the slice) is right on exactly one rank of the group: the one whose slice holds the
row's scored token, found from the whole row before slicing (``scored_slice``). The others' scores are dropped and
the row's score is the sum over the group (``SequenceParallel.sum_over_group``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from shardtune.engines.base import Engine
from shardtune.train.loop import Batch, count_input_tokens, rank_rows, to_device
from shardtune.train.preference import LossOutput, pairwise_reward_loss
from shardtune.train.preference_step import MetricTotals, global_pairs, rows, rows_scope

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


@dataclass
class RewardObjective:
    """The rm objective the loop calls instead of the token loss."""

    pad_token_id: int  # the score head's pooling skips these tokens (model/reward_head.py)

    def train_step(self, engine: Engine, window: list[Batch], max_grad_norm: float) -> dict[str, float]:
        window = [to_device(self.split_rows(engine, b), engine.device) for b in window]
        pairs = global_pairs(engine, window)
        denominator = torch.clamp(pairs, min=1.0)
        totals = MetricTotals(REWARD_METRICS, engine.device)
        for i, batch in enumerate(window):
            with rows_scope(engine, batch, 0, 2 * int(batch["pairs"])):
                with engine.accumulation_context(is_last_micro_batch=i == len(window) - 1), engine.autocast():
                    out = self.batch_losses(engine, batch)
                engine.backward(out.losses.sum() * engine.loss_scale_for_mean_reduction / denominator)
            totals.add(out)
        grad_norm = engine.step(max_grad_norm)
        counts = engine.all_reduce_sum(torch.tensor(
            [float(sum(count_input_tokens(b) for b in window)), float(sum(b["input_ids"].numel() for b in window))],
            device=engine.device))
        return {**totals.reduced(engine), "grad_norm": grad_norm, "tokens": float(counts[0]),
                "slots": float(counts[1]), "trainable_tokens": float(pairs)}

    @torch.no_grad()
    def evaluate(self, engine: Engine, batches: Iterable[Batch]) -> dict[str, float]:
        """Mean pairwise loss, reward accuracy and margins over the eval data, over all ranks."""
        engine.model.eval()
        totals = MetricTotals(REWARD_METRICS, engine.device)
        for batch in batches:
            batch = to_device(self.split_rows(engine, batch), engine.device)
            with rows_scope(engine, batch, 0, 2 * int(batch["pairs"])), engine.autocast():
                totals.add(self.batch_losses(engine, batch))
        engine.model.train()
        return totals.reduced(engine)

    def split_rows(self, engine: Engine, batch: Batch) -> Batch:
        """This rank's slice of every row and, under sequence parallelism, which slice holds each row's score."""
        if engine.sequence is None:
            return batch
        owner = scored_slice(batch["input_ids"], self.pad_token_id, engine.sequence.size)
        return rank_rows(engine, {**batch, "scored_slice": owner})

    @staticmethod
    def batch_losses(engine: Engine, batch: Batch) -> LossOutput:
        n = int(batch["pairs"])
        scores = engine.model(**rows(batch, 0, 2 * n), use_cache=False).logits.reshape(-1)
        if engine.sequence is not None:
            mine = batch["scored_slice"] == engine.sequence.index
            scores = engine.sequence.sum_over_group(torch.where(mine, scores, torch.zeros_like(scores)))
        return pairwise_reward_loss(scores[:n], scores[n:])


def scored_slice(input_ids: torch.Tensor, pad_token_id: int, size: int) -> torch.Tensor:
    """Per row, which of ``size`` equal slices holds the token the score is read at: the rightmost one that is not
    ``pad_token_id`` (transformers' sequence-classification pooling; position 0 in a row of padding only). That
    slice's own pooling picks the same token, since every token after it is padding."""
    length = input_ids.shape[1]
    positions = torch.arange(length, device=input_ids.device)
    last = (positions * (input_ids != pad_token_id)).argmax(-1)
    return last // (length // size)
