"""Preference losses (DPO and its hinge, IPO, ORPO, SimPO variants; KTO; pairwise reward models), pure torch.

Every function takes per-sequence log-probabilities (summed over response tokens, with the response lengths)
and returns the *per-pair* (or per-example) losses, not their mean: the loop divides the sum by the number of
pairs in the whole accumulation window across ranks, so gradient accumulation and data parallelism give the
update of one big batch, as for the token-normalised SFT loss. The metrics are per-pair values too, averaged
the same way.

The formulas follow LLaMA-Factory's ``CustomDPOTrainer`` / ``CustomKTOTrainer`` / ``PairwiseTrainer`` (which
call TRL's): IPO, ORPO and SimPO use length-averaged log-probabilities; ``pref_ftx`` adds ``ftx`` times the
chosen answer's average negative log-likelihood; ORPO always adds that SFT term. tests/unit/test_preference_losses.py
checks them against TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardtune.config.preference import REFERENCE_FREE_LOSSES
from shardtune.data.settings import IGNORE_INDEX

PAIR_LOSSES = ("sigmoid", "hinge", "ipo", "orpo", "simpo")
# These score length-averaged log-probabilities (LLaMA-Factory divides by the response length for them).
LENGTH_AVERAGED_LOSSES = ("ipo", "orpo", "simpo")


@dataclass(frozen=True)
class PreferenceSettings:
    """The preference keys of one run (LLaMA-Factory names in the config: pref_loss, pref_beta, ...)."""

    loss: str = "sigmoid"
    beta: float = 0.1
    ftx: float = 0.0
    simpo_gamma: float = 0.5
    label_smoothing: float = 0.0
    kto_chosen_weight: float = 1.0
    kto_rejected_weight: float = 1.0

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE_LOSSES

    @property
    def averages_lengths(self) -> bool:
        return self.loss in LENGTH_AVERAGED_LOSSES


@dataclass(frozen=True)
class PairLogps:
    """Summed response log-probabilities of the chosen and rejected answers of each pair, and their lengths."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_lengths: torch.Tensor
    rejected_lengths: torch.Tensor

    def averaged(self) -> PairLogps:
        return PairLogps(self.chosen / self.chosen_lengths.clamp(min=1), self.rejected / self.rejected_lengths.clamp(
            min=1), self.chosen_lengths, self.rejected_lengths)


@dataclass(frozen=True)
class LossOutput:
    """Per-pair (per-example) losses and per-pair metric values, both to be averaged over the global batch."""

    losses: torch.Tensor
    metrics: dict[str, torch.Tensor]


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of the labelled (response) tokens under ``logits``, and their count.

    Position i predicts token i + 1; labels of -100 (prompt, padding) count for nothing. fp32 whatever the
    logits' dtype, as the SFT loss.
    """
    return target_logps(logits[:, :-1, :], labels[:, 1:])


def target_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logps`` with the targets already shifted (``targets[:, i]`` is the token position i predicts), as a
    sequence-parallel slice holds them (train/sequence_shards.py): the slice's share of each row's sum and count."""
    mask = targets != IGNORE_INDEX
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = torch.gather(logprobs, 2, targets.masked_fill(~mask, 0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def preference_loss(s: PreferenceSettings, policy: PairLogps, reference: PairLogps | None) -> LossOutput:
    """``s.loss`` for every pair; ``reference`` is None exactly for the reference-free losses (ORPO, SimPO)."""
    if s.needs_reference != (reference is not None):
        state = "missing" if reference is None else "given"
        raise ValueError(f"pref_loss {s.loss}: reference log-probabilities {state}")
    if s.averages_lengths:
        policy = policy.averaged()
        reference = reference.averaged() if reference is not None else None
    if reference is None:
        losses = orpo_losses(policy, s.beta) if s.loss == "orpo" else simpo_losses(policy, s.beta, s.simpo_gamma)
        chosen_rewards, rejected_rewards = s.beta * policy.chosen.detach(), s.beta * policy.rejected.detach()
    else:
        losses = dpo_losses(s, policy, reference)
        chosen_rewards = s.beta * (policy.chosen - reference.chosen).detach()
        rejected_rewards = s.beta * (policy.rejected - reference.rejected).detach()
    sft = -_average_chosen(policy, s.averages_lengths)
    if s.ftx > 1e-6:
        losses = losses + s.ftx * sft
    metrics = reward_metrics(chosen_rewards, rejected_rewards)
    metrics.update({"logps/chosen": policy.chosen.detach(), "logps/rejected": policy.rejected.detach()})
    if s.loss == "orpo":
        metrics["sft_loss"] = sft.detach()
        metrics["odds_ratio_loss"] = ((losses.detach() - sft.detach()) / s.beta)
    return LossOutput(losses, metrics)


def _average_chosen(policy: PairLogps, already_averaged: bool) -> torch.Tensor:
    return policy.chosen if already_averaged else policy.chosen / policy.chosen_lengths.clamp(min=1)


def dpo_losses(s: PreferenceSettings, policy: PairLogps, reference: PairLogps) -> torch.Tensor:
    """DPO (``sigmoid``, with conservative label smoothing), ``hinge`` and ``ipo`` on the log-ratio margin."""
    logits = (policy.chosen - policy.rejected) - (reference.chosen - reference.rejected)
    if s.loss == "sigmoid":
        return (-F.logsigmoid(s.beta * logits) * (1 - s.label_smoothing)
                - F.logsigmoid(-s.beta * logits) * s.label_smoothing)
    if s.loss == "hinge":
        return torch.relu(1 - s.beta * logits)
    if s.loss == "ipo":
        # Eq. 17 of the IPO paper; beta plays its tau.
        return (logits - 1 / (2 * s.beta)) ** 2
    raise ValueError(f"unknown pref_loss {s.loss!r}; expected one of {PAIR_LOSSES}")


def orpo_losses(policy: PairLogps, beta: float) -> torch.Tensor:
    """ORPO: the chosen answer's NLL plus beta x -log sigmoid(log odds ratio), on averaged log-probabilities."""
    log_odds = (policy.chosen - policy.rejected) - (_log1m_exp(policy.chosen) - _log1m_exp(policy.rejected))
    return -policy.chosen - beta * F.logsigmoid(log_odds)


def _log1m_exp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp < 0 (the probability's complement), as LLaMA-Factory computes it."""
    return torch.log1p(-torch.exp(logp))


def simpo_losses(policy: PairLogps, beta: float, gamma: float) -> torch.Tensor:
    """SimPO: -log sigmoid(beta x (averaged margin - gamma / beta))."""
    return -F.logsigmoid(beta * ((policy.chosen - policy.rejected) - gamma / beta))


def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "rewards/margins": chosen_rewards - rejected_rewards}


def kto_kl_estimate(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor) -> torch.Tensor:
    """This batch's mean log-ratio on mismatched (prompt, other answer) pairs: KTO's reference point z0 before the
    mean over ranks and the clamp at 0 (``kto_losses`` takes the final value)."""
    return (policy_kl_logps - reference_kl_logps).mean().detach()


def kto_losses(s: PreferenceSettings, policy_logps: torch.Tensor, reference_logps: torch.Tensor,
               desirable: torch.Tensor, kl: torch.Tensor) -> LossOutput:
    """KTO (Eq. 7 of the paper): per-example losses, weighted by kto_chosen_weight / kto_rejected_weight.

    ``desirable`` is the boolean ``kto_tag`` of each example; ``kl`` the reference point, already averaged over
    ranks and clamped at 0 (detached: no gradient flows through it).
    """
    logratios = policy_logps - reference_logps
    chosen_losses = 1 - torch.sigmoid(s.beta * (logratios - kl))
    rejected_losses = 1 - torch.sigmoid(s.beta * (kl - logratios))
    losses = torch.where(desirable, s.kto_chosen_weight * chosen_losses, s.kto_rejected_weight * rejected_losses)
    rewards = s.beta * logratios.detach()
    metrics = {"rewards/chosen": rewards[desirable], "rewards/rejected": rewards[~desirable],
               "logps/chosen": policy_logps.detach()[desirable], "logps/rejected": policy_logps.detach()[~desirable],
               "kl": kl.reshape(1)}
    return LossOutput(losses, metrics)


def pairwise_reward_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> LossOutput:
    """Reward model: -log sigmoid(r_chosen - r_rejected) per pair, on the scalar head's score of the last token."""
    chosen_scores, rejected_scores = chosen_scores.float(), rejected_scores.float()
    losses = -F.logsigmoid(chosen_scores - rejected_scores)
    metrics = reward_metrics(chosen_scores.detach(), rejected_scores.detach())
    return LossOutput(losses, metrics)
