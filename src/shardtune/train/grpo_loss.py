"""GRPO's loss and its variants (DAPO, Dr. GRPO, GSPO), pure torch, as TRL 1.16's ``GRPOTrainer`` computes them.

Every function takes per-token tensors of one group of completions (``mask`` marks the tokens that count) and a
``denominator`` that belongs to the whole step: the step's completion tokens over every rank (dapo), its completions
(grpo, gspo) or its completions x max_completion_length (dr_grpo). Summing the returned values over every group of
every micro-batch and rank then gives the loss of one big batch, so gradient accumulation and data parallelism do not
change the update (TRL averages per micro-batch and over ranks, the same when every micro-batch holds as many
completions, which shardtune's batches do). tests/unit/test_grpo_oracle.py checks them against TRL.

A generator with weights of its own (vLLM, or its CPU stand-in) samples from a distribution a little apart from the
trainer's (other kernels, another dtype). ``sampler_ratio`` is TRL's correction for that gap
(``vllm_importance_sampling_*``): each token's (or each completion's) ratio of the trainer's probability to the
sampler's, truncated to or masked outside [clip_min, clip_max], multiplies the surrogate loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")
# Added to the reward std before dividing, as TRL does, so a group whose rewards are all equal gets advantages 0.
STD_EPSILON = 1e-4


@dataclass(frozen=True)
class GrpoSettings:
    """The loss keys of one run (TRL's names)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    temperature: float = 1.0
    use_bias_correction_kl: bool = True

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class SamplerCorrection:
    """TRL's ``vllm_importance_sampling_mode`` and its clip bounds (None: unbounded on that side)."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0


def sampler_ratio(c: SamplerCorrection, old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
                  ) -> torch.Tensor:
    """exp(trainer - sampler log-probability) per token (``token_*``: shape of the logps) or summed per completion
    (``sequence_*``: one column); ``*_truncate`` clamps it to the bounds, ``*_mask`` zeroes it outside them. A token
    the sampler could not score (NaN) counts as no gap."""
    gap = torch.nan_to_num((old_logps - sampler_logps) * mask, nan=0.0)
    if c.mode.startswith("sequence"):
        gap = gap.sum(-1, keepdim=True)
    ratio = torch.exp(gap)
    if c.mode.endswith("truncate"):
        return torch.clamp(ratio, min=c.clip_min, max=c.clip_max)
    low = -math.inf if c.clip_min is None else c.clip_min
    high = math.inf if c.clip_max is None else c.clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@dataclass(frozen=True)
class TokenTerms:
    """One group's per-token loss (before aggregation), KL (None when beta is 0) and importance ratio."""

    loss: torch.Tensor
    kl: torch.Tensor | None
    ratio: torch.Tensor


def completion_logps(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token log-probabilities of ``completion_ids`` under ``logits`` of the same positions (already shifted:
    ``logits[:, t]`` predicts ``completion_ids[:, t]``), at the sampling temperature, in fp32."""
    scaled = logits.float() / temperature
    picked = torch.gather(scaled, -1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str,
                     batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """Each completion's reward minus its group's mean, divided by the group's std (``group``), the whole step's std
    (``batch``: ``batch_std``, computed over every rank) or nothing (``none``); std is the unbiased one."""
    grouped = rewards.view(-1, num_generations)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    else:
        assert batch_std is not None, "scale_rewards batch needs the step's reward std"
        std = batch_std.expand_as(centred)
    return centred / (std + STD_EPSILON)


def token_terms(s: GrpoSettings, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, ref_logps: torch.Tensor | None, sampler: torch.Tensor | None = None
                ) -> TokenTerms:
    """The clipped surrogate per token (gspo: one ratio per sequence, the exp of its mean log-ratio), times the
    sampler correction when there is one (``sampler_ratio``), plus beta x the k3 estimate of KL(policy || reference)
    (times the ratio with ``use_bias_correction_kl``)."""
    log_ratio = logps - old_logps
    if s.loss_type == "gspo":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.upper_epsilon)
    adv = advantages.unsqueeze(-1)
    loss = -torch.min(ratio * adv, clipped * adv)
    if sampler is not None:
        loss = loss * sampler
    kl = None
    if s.beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probabilities"
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if s.use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + s.beta * kl
    return TokenTerms(loss, kl, ratio)


def aggregate(loss_type: str, per_token: torch.Tensor, mask: torch.Tensor, denominator: torch.Tensor | float
              ) -> torch.Tensor:
    """This group's share of the step's loss: masked token sum (dapo, dr_grpo) or sum of per-sequence token means
    (grpo, gspo), over the step's ``denominator`` (see the module docstring)."""
    mask = mask.to(per_token.dtype)
    if loss_type in ("grpo", "gspo"):
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_sequence.sum() / denominator
    return (per_token * mask).sum() / denominator


def clip_fractions(s: GrpoSettings, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums (over tokens that count) of where the lower and where the upper clip bound the objective, for the logs."""
    adv = advantages.unsqueeze(-1)
    low = ((ratio < 1 - s.epsilon) & (adv < 0)).expand_as(mask) & mask.bool()
    high = ((ratio > 1 + s.upper_epsilon) & (adv > 0)).expand_as(mask) & mask.bool()
    return low.sum().float(), high.sum().float()
