"""One optimizer step of stage grpo on any engine: rollouts, rewards, advantages, then the clipped surrogate.

A micro-batch holds ``per_device_train_batch_size / num_generations`` prompts (``data.rl_prompts``); each is one
group of ``num_generations`` completions, generated, scored and trained on as a unit, so a group's advantages need
no other rank. The step's loss denominator (completion tokens, completions, or completions x max_completion_length:
train/grpo_loss.py) is summed over every rank before the first backward, so 2 processes train as one with the same
global batch. With ``num_iterations`` > 1 the loader hands the same window that many times in a row (the step
function below keeps its rollouts for it) and the old log-probabilities are the policy's before the first of
those steps, as TRL's ``num_iterations`` does. With ``beta`` > 0 the reference is placed as dpo's is
(train/preference_step.py): the adapters-off policy for LoRA, a frozen copy placed by the engine for full runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardtune.engines.base import Engine
from shardtune.train.grpo_group import Group, group_from, load_rollouts, rollouts_file_name, rollouts_payload
from shardtune.train.grpo_loss import (
    GrpoSettings,
    SamplerCorrection,
    aggregate,
    clip_fractions,
    completion_logps,
    group_advantages,
    sampler_ratio,
    token_terms,
)
from shardtune.train.grpo_rewards import RewardSet
from shardtune.train.preference_step import Reference
from shardtune.train.rollout import Rollout, Sampling
from shardtune.train.weight_sync import WeightSync


@dataclass
class GrpoObjective:
    """The grpo objective the loop calls instead of the token loss."""

    settings: GrpoSettings
    sampling: Sampling
    rewards: RewardSet
    rollout: Rollout
    tokenizer: Any
    num_generations: int
    scale_rewards: str = "group"
    num_iterations: int = 1
    mask_truncated: bool = False
    reference: Reference | None = None
    weight_sync: WeightSync | None = None  # a generator with its own weights (rollout_backend vllm_protocol_cpu)
    correction: SamplerCorrection | None = None  # for that generator's gap (vllm_importance_sampling_correction)
    _kept: tuple[Any, list[Group]] | None = None  # the window's first micro-batch and its groups
    _repeats_done: int = 0  # steps trained on the kept groups
    _restored: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # by row, from a checkpoint

    def train_step(self, engine: Engine, window: list[dict[str, Any]], max_grad_norm: float) -> dict[str, float]:
        sync_seconds = self.weight_sync.before_rollouts(engine) if self.weight_sync is not None else 0.0
        started = time.perf_counter()
        groups = self.window_rollouts(engine, window)
        rollout_seconds = time.perf_counter() - started
        totals = engine.all_reduce_sum(torch.tensor([float(sum(g.mask.sum() for g in groups)),
                                                     float(sum(len(g.mask) for g in groups))], device=engine.device))
        tokens, rows = totals[0], totals[1]
        denominator = {"dapo": tokens.clamp(min=1.0),
                       "dr_grpo": rows * self.sampling.max_completion_length}.get(self.settings.loss_type, rows)
        sums = torch.zeros(len(METRICS) + len(self.rewards.names), dtype=torch.float64, device=engine.device)
        for i, group in enumerate(groups):
            with engine.accumulation_context(is_last_micro_batch=i == len(groups) - 1), engine.autocast():
                logps = self.policy_logps(engine, engine.model, group)
                old = group.old_logps if group.old_logps is not None else logps.detach()
                terms = token_terms(self.settings, logps, old, group.advantages, group.mask, group.ref_logps,
                                    group.sampler)
                loss = aggregate(self.settings.loss_type, terms.loss, group.mask, denominator)
            engine.backward(loss * engine.loss_scale_for_mean_reduction)
            sums += self.group_metrics(group, terms, loss.detach())
        grad_norm = engine.step(max_grad_norm)
        metrics = self.step_metrics(engine, sums, len(self.rewards.names), grad_norm, rollout_seconds)
        if self.correction is not None:
            metrics.update(sampler_metrics(engine, groups))
        if self.weight_sync is not None:  # every rank, after every optimizer step, whatever it generated
            metrics["weight_sync_seconds"] = sync_seconds + self.weight_sync.after_step(engine)
        return metrics

    def evaluate(self, engine: Engine, batches: Any) -> dict[str, float]:
        raise NotImplementedError("stage grpo has no evaluation (refused by config/grpo.py)")

    # --- rollouts ---
    def window_rollouts(self, engine: Engine, window: list[dict[str, Any]]) -> list[Group]:
        """The window's groups: generated, scored and given advantages once, then reused for the repeats of the same
        window (num_iterations > 1); a run resumed between two repeats takes them from the checkpoint."""
        if self._kept is not None and self._kept[0] is window[0]:
            self._repeats_done += 1
            return self._kept[1]
        rows = [(prompt, columns, row) for batch in window
                for prompt, columns, row in zip(batch["prompt_ids"], batch["columns"], batch["index"], strict=True)]
        groups = self.restored_groups(engine, rows) or self.new_groups(engine, rows)
        self._kept, self._repeats_done = (window[0], groups), 1
        return groups

    def new_groups(self, engine: Engine, rows: list[tuple[list[int], dict[str, Any], int]]) -> list[Group]:
        groups = [self.group(engine, prompt, columns, row) for prompt, columns, row in rows]
        batch_std = self.batch_std(engine, groups) if self.scale_rewards == "batch" else None
        for group in groups:
            group.advantages = group_advantages(self.rewards.combined(group.rewards), self.num_generations,
                                                self.scale_rewards, batch_std).to(engine.device)
        with torch.no_grad():
            for group in groups:
                if self.num_iterations > 1 or self.correction is not None:
                    group.old_logps = self.policy_logps(engine, engine.model, group)
                if self.correction is not None:
                    group.sampler = self.sampler_ratio(engine, group)
                if self.reference is not None:
                    group.ref_logps = self.reference_logps(engine, group)
        return groups

    # --- resume between two repeats of a window (train/grpo_group.py) ---
    def checkpoint_files(self, engine: Engine) -> dict[str, Any]:
        """This rank's groups while repeats of their window are still to come, for the checkpoint."""
        if self._kept is None or self._repeats_done >= self.num_iterations:
            return {}
        return {rollouts_file_name(engine.rank): rollouts_payload(self._kept[1])}

    def restore_from(self, engine: Engine, checkpoint: Path) -> None:
        self._restored = load_rollouts(checkpoint)

    def restored_groups(self, engine: Engine, rows: list[tuple[list[int], dict[str, Any], int]]
                        ) -> list[Group] | None:
        """The checkpoint's groups of these rows (the first window after a resume between its repeats), once."""
        restored, self._restored = self._restored, {}
        if not restored or any(row not in restored for _, _, row in rows):
            return None
        return [group_from(row, restored[row], engine.device) for _, _, row in rows]

    def group(self, engine: Engine, prompt_ids: list[int], columns: dict[str, Any], row: int) -> Group:
        completions = self.rollout.generate(prompt_ids, self.num_generations, self.sampling, row)
        texts = [self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                 for ids, mask in zip(completions.ids.cpu(), completions.mask.cpu(), strict=True)]
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        rows = [prompt_ids + ids[mask.bool()].tolist()
                for ids, mask in zip(completions.ids.cpu(), completions.mask.cpu(), strict=True)]
        rewards = self.rewards.score(prompt_text, texts, columns, row, rows)
        mask = completions.mask
        if self.mask_truncated:
            mask = mask * (~completions.truncated).long().unsqueeze(1)
        return Group(torch.tensor(prompt_ids, dtype=torch.long, device=engine.device), completions,
                     mask.to(engine.device), rewards, row=row)

    def batch_std(self, engine: Engine, groups: list[Group]) -> torch.Tensor:
        """The unbiased std of every completion's reward of the step, over all ranks (scale_rewards: batch)."""
        rewards = torch.cat([self.rewards.combined(g.rewards) for g in groups]).double()
        summed = engine.all_reduce_sum(torch.stack([rewards.sum(), (rewards ** 2).sum(),
                                                    torch.tensor(float(len(rewards)), dtype=torch.float64)]
                                                   ).to(engine.device))
        total, squares, count = summed.tolist()
        variance = (squares - total * total / count) / max(count - 1, 1.0)
        return torch.tensor(max(variance, 0.0) ** 0.5, dtype=torch.float32)

    # --- log-probabilities ---
    def sampler_ratio(self, engine: Engine, group: Group) -> torch.Tensor:
        """The correction of this group's sampler/trainer gap; the generator must have said what it sampled with."""
        assert self.correction is not None and group.old_logps is not None
        sampled = group.completions.logps
        if sampled is None:
            raise RuntimeError("the generator returned no log-probabilities, which the importance-sampling "
                               "correction needs (vllm_importance_sampling_correction: false turns it off)")
        return sampler_ratio(self.correction, group.old_logps, sampled.to(engine.device), group.mask)

    def policy_logps(self, engine: Engine, model: torch.nn.Module, group: Group) -> torch.Tensor:
        ids, attention = self.inputs(engine, group)
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        return self.completion_part(logits, group)

    def reference_logps(self, engine: Engine, group: Group) -> torch.Tensor:
        assert self.reference is not None
        ids, attention = self.inputs(engine, group)
        return self.completion_part(self.reference.logits(engine, {"input_ids": ids, "attention_mask": attention}),
                                    group)

    def inputs(self, engine: Engine, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(group.mask)
        ids = torch.cat([group.prompt.expand(n, -1), group.completions.ids.to(engine.device)], dim=1)
        attention = torch.cat([torch.ones(n, len(group.prompt), dtype=torch.long, device=engine.device),
                               group.completions.mask.to(engine.device)], dim=1)
        return ids, attention

    def completion_part(self, logits: torch.Tensor, group: Group) -> torch.Tensor:
        start = len(group.prompt) - 1  # position P - 1 predicts the first completion token
        width = group.completions.ids.shape[1]
        return completion_logps(logits[:, start:start + width], group.completions.ids.to(logits.device),
                                self.settings.temperature)

    # --- metrics ---
    def group_metrics(self, group: Group, terms: Any, loss: torch.Tensor) -> torch.Tensor:
        """This group's sums of the logged numbers, in METRICS order then one reward mean per function."""
        mask = group.mask.double()
        combined = self.rewards.combined(group.rewards).double()
        low, high = clip_fractions(self.settings, terms.ratio.detach(), group.advantages, group.mask)
        kl = (terms.kl.detach().double() * mask).sum() if terms.kl is not None else torch.zeros((), dtype=torch.float64)
        n = float(len(combined))
        values = [loss.double(), combined.sum(), combined.std().double() * n, mask.sum(),
                  group.completions.mask.double().sum(), group.completions.truncated.double().sum(), kl.cpu(),
                  low.double(), high.double(), n * float(bool(combined.std() < 1e-6)), torch.tensor(n)]
        per_function = group.rewards.double().sum(0)
        return torch.cat([torch.stack([torch.as_tensor(v, dtype=torch.float64).cpu() for v in values]),
                          per_function]).to(mask.device)

    def step_metrics(self, engine: Engine, sums: torch.Tensor, functions: int, grad_norm: float,
                     rollout_seconds: float) -> dict[str, float]:
        summed = engine.all_reduce_sum(sums).tolist()
        found = dict(zip(METRICS, summed, strict=False))
        n, tokens = max(found["completions"], 1.0), max(found["tokens"], 1.0)
        metrics = {"loss": found["loss"], "reward": found["reward"] / n, "reward_std": found["reward_std"] / n,
                   "completions/mean_length": found["lengths"] / n,
                   "completions/clipped_ratio": found["truncated"] / n,
                   "clip_ratio/low_mean": found["clip_low"] / tokens,
                   "clip_ratio/high_mean": found["clip_high"] / tokens,
                   "frac_reward_zero_std": found["zero_std"] / n, "rollout_seconds": rollout_seconds,
                   "grad_norm": grad_norm, "tokens": found["lengths"], "slots": found["lengths"],
                   "trainable_tokens": found["tokens"]}
        if self.settings.beta:
            metrics["kl"] = found["kl"] / tokens
        for i, name in enumerate(self.rewards.labels):
            metrics[f"rewards/{name}/mean"] = summed[len(METRICS) + i] / n
        return metrics


def sampler_metrics(engine: Engine, groups: list[Group]) -> dict[str, float]:
    """TRL's sampling/* logs of the step, over every rank: the |trainer - sampler| log-probability gap of the tokens
    that count (mean, max) and the correction's ratio (per token, or per completion in the sequence modes)."""
    gaps, ratios = [torch.zeros(0, dtype=torch.float64)], [torch.zeros(0, dtype=torch.float64)]
    for g in groups:
        assert g.old_logps is not None and g.completions.logps is not None and g.sampler is not None
        counted = g.mask.bool()
        gap = (g.old_logps - g.completions.logps.to(g.old_logps.device)).abs()[counted]
        gaps.append(gap[~gap.isnan()].double().cpu())
        per_token = g.sampler.shape == g.mask.shape
        ratios.append((g.sampler[counted] if per_token else g.sampler.flatten()).double().cpu())
    gap, ratio = torch.cat(gaps), torch.cat(ratios)
    sums = engine.all_reduce_sum(torch.tensor([gap.sum(), len(gap), ratio.sum(), len(ratio)], dtype=torch.float64,
                                              device=engine.device)).tolist()
    ends = engine.gather_objects([gap.max().item() if len(gap) else 0.0, ratio.min().item(), ratio.max().item()]
                                 if len(ratio) else None)
    found = [e for e in ends if e is not None] or [[0.0, 0.0, 0.0]]
    return {"sampling/sampling_logp_difference/mean": sums[0] / max(sums[1], 1.0),
            "sampling/sampling_logp_difference/max": max(e[0] for e in found),
            "sampling/importance_sampling_ratio/min": min(e[1] for e in found),
            "sampling/importance_sampling_ratio/mean": sums[2] / max(sums[3], 1.0),
            "sampling/importance_sampling_ratio/max": max(e[2] for e in found)}


# The sums every group adds (group_metrics), reduced over ranks in one call.
METRICS = ("loss", "reward", "reward_std", "tokens", "lengths", "truncated", "kl", "clip_low", "clip_high",
           "zero_std", "completions")
