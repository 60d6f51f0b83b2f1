"""stage rm: a pairwise reward model, saved as a transformers sequence-classification model with one label.

The causal LM is loaded as for every stage, then its body is moved into ``AutoModelForSequenceClassification``
(``num_labels=1``; the output layer is dropped, a new ``score`` layer of one row is drawn with the run's seed), so
the saved folder loads with ``AutoModelForSequenceClassification.from_pretrained`` and its ``config.json`` names
the class. The score of a sequence is the head's output at its last non-padding token (transformers' pooling: the
model's ``pad_token_id`` is the tokenizer's). The loss is -log sigmoid(r_chosen - r_rejected) per pair
(train/preference.py), averaged over all pairs of the window across ranks like the other preference stages.

Full fine-tuning on one process, DDP, ZeRO-0/1/2/3 and FSDP1/2 (``build_reward_model``: how the score layer is
placed); LoRA and freeze are refused before launch (launch/validate.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from shardtune.engines.base import Engine
from shardtune.engines.sharded_loading import ShardedLoad
from shardtune.errors import ModelError
from shardtune.train.loop import Batch, count_input_tokens, to_device
from shardtune.train.preference import LossOutput, pairwise_reward_loss
from shardtune.train.preference_step import MetricTotals, rows

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def build_reward_model(causal_lm: torch.nn.Module, pad_token_id: int, seed: int,
                       loading: ShardedLoad | None = None) -> torch.nn.Module:
    """A one-label sequence-classification model holding ``causal_lm``'s body (its weights, not a copy).

    The score layer is drawn here, on the host with the run's seed, the same on every engine and rank. ``loading``:
    a sharding engine that fills a meta skeleton from the files after sharding (FSDP) takes the score's values from
    it as it takes an adapter's starting values (the body keeps its names, ``model.*``, so the files still name it).
    Under ZeRO-3 the body arrives partitioned and filled; DeepSpeed partitions the plain score layer when it wraps
    the model."""
    from transformers import AutoModelForSequenceClassification

    config: Any = copy.deepcopy(causal_lm.config)  # a transformers PretrainedConfig
    config.num_labels, config.pad_token_id = 1, pad_token_id
    config.architectures = None  # save_pretrained writes the new class
    # The class's own body is never allocated (meta); the causal LM's body takes its place.
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(
            config, dtype=torch.float32, attn_implementation=config._attn_implementation)
    body_name = model.base_model_prefix
    body = getattr(causal_lm, body_name, None)
    head = getattr(model, "score", None)
    if body is None or not isinstance(head, torch.nn.Linear):
        raise ModelError(f"stage rm: {type(causal_lm).__name__} has no '{body_name}' body or its sequence-"
                         "classification class no 'score' layer; this architecture cannot be a reward model here")
    setattr(model, body_name, body)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.score = torch.nn.Linear(head.in_features, 1, bias=head.bias is not None)
        torch.nn.init.normal_(model.score.weight, std=getattr(config, "initializer_range", 0.02))
    if any(p.is_meta for p in model.parameters() if not any(p is q for q in body.parameters())):
        raise ModelError(f"stage rm: {type(model).__name__} has layers besides '{body_name}' and 'score'; this "
                         "architecture cannot be a reward model here")
    if loading is not None:
        loading.initial.update({f"score.{name}": p.detach().clone() for name, p in model.score.named_parameters()})
    model.requires_grad_(True)
    if getattr(causal_lm, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


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
