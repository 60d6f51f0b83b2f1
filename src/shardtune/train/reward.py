"""stage rm: the pairwise reward objective. The model is the causal LM's body under a one-label score head
(model/reward_head.py, built by the model source before fine-tuning is applied, so full, freeze and LoRA runs and
every engine place it as any other model).

The loss is -log sigmoid(r_chosen - r_rejected) per pair (train/preference.py), averaged over all pairs of the
window across ranks like the other preference stages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from shardtune.engines.base import Engine
from shardtune.train.loop import Batch, count_input_tokens, to_device
from shardtune.train.preference import LossOutput, pairwise_reward_loss
from shardtune.train.preference_step import MetricTotals, rows

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


@dataclass
class RewardObjective:
    """The rm objective the loop calls instead of the token loss."""

    def train_step(self, engine: Engine, window: list[Batch], max_grad_norm: float) -> dict[str, float]:
        window = [to_device(b, engine.device) for b in window]
        pairs = engine.all_reduce_sum(torch.tensor(float(sum(b["pairs"] for b in window)), device=engine.device))
        denominator = torch.clamp(pairs, min=1.0)
        totals = MetricTotals(REWARD_METRICS, engine.device)
        for i, batch in enumerate(window):
            with engine.accumulation_context(is_last_micro_batch=i == len(window) - 1), engine.autocast():
                out = self.batch_losses(engine.model, batch)
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
            batch = to_device(batch, engine.device)
            with engine.autocast():
                totals.add(self.batch_losses(engine.model, batch))
        engine.model.train()
        return totals.reduced(engine)

    @staticmethod
    def batch_losses(model: torch.nn.Module, batch: Batch) -> LossOutput:
        n = int(batch["pairs"])
        scores = model(**rows(batch, 0, 2 * n), use_cache=False).logits.reshape(-1)
        return pairwise_reward_loss(scores[:n], scores[n:])
