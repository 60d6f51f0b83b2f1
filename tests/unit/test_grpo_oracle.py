"""GRPO's loss against TRL 1.16's own ``GRPOTrainer._compute_loss`` on the same tensors (TRL is the oracle).

Completions, advantages, old and reference log-probabilities are injected (fixed tensors); TRL scores them through
its fused LM head on one copy of a tiny LLaMA, shardtune (train/grpo_loss.py, group by group as the objective does)
on another copy with the same weights. The loss, the per-token log-probabilities, the mean KL, the clip fractions and
every parameter's gradient must agree within 1e-6 (fp32), for each loss type, beta 0 and > 0, on-policy
(num_iterations 1: old = current) and off-policy (num_iterations 2: old log-probabilities from before a step).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

from shardtune.train.grpo_loss import (  # noqa: E402
    GrpoSettings,
    SamplerCorrection,
    aggregate,
    clip_fractions,
    completion_logps,
    group_advantages,
    sampler_ratio,
    token_terms,
)

B, N, P, L, MAX_LEN, TEMPERATURE = 8, 4, 5, 7, 9, 0.7
TOLERANCE = 1e-6
# shardtune's loss_type -> TRL's (loss_type, importance_sampling_level): GSPO is TRL's grpo at the sequence level.
TRL_NAMES = {"grpo": ("grpo", "token"), "dapo": ("dapo", "token"), "dr_grpo": ("dr_grpo", "token"),
             "gspo": ("grpo", "sequence")}


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).float()


def injected(policy: torch.nn.Module, off_policy: bool, beta: float) -> dict[str, torch.Tensor]:
    """Fixed prompts and completions (right-padded, some ending early), advantages, and the old and reference
    log-probabilities from perturbed copies of the policy (old: as if one step had been taken since sampling)."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, 61, (B, P), generator=g)
    completion_ids = torch.randint(3, 61, (B, L), generator=g)
    lengths = torch.tensor([7, 3, 5, 7, 1, 6, 7, 2])
    completion_mask = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rewards = torch.randint(0, 3, (B,), generator=g).float()
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": group_advantages(rewards, N, "group"),
              "num_items_in_batch": completion_mask.sum()}
    if off_policy:
        inputs["old_per_token_logps"] = perturbed_logps(policy, inputs, seed=2, scale=0.05)
    if beta:
        inputs["ref_per_token_logps"] = perturbed_logps(policy, inputs, seed=3, scale=0.1)
    return inputs


@torch.no_grad()
def perturbed_logps(policy: torch.nn.Module, inputs: dict[str, torch.Tensor], seed: int, scale: float
                    ) -> torch.Tensor:
    other = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(seed)
    for p in other.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)
    return our_logps(other, inputs)


def our_logps(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, P - 1:-1]
    return completion_logps(logits, inputs["completion_ids"], TEMPERATURE)


def trl_trainer(model: torch.nn.Module, loss_type: str, beta: float, corrected: bool = False) -> SimpleNamespace:
    """The attributes ``GRPOTrainer._compute_loss`` and ``_get_per_token_logps_and_entropies`` read, for one
    process and one micro-batch per step (accumulation 1, steps_per_generation 1), with their methods bound."""
    name, level = TRL_NAMES[loss_type]
    accelerator = SimpleNamespace(autocast=contextlib.nullcontext, reduce=lambda x, reduction="sum": x,
                                  gather=lambda x: x, gather_for_metrics=lambda x: x, num_processes=1,
                                  is_main_process=True, sync_gradients=True)
    args = SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=1)
    trainer = SimpleNamespace(
        model=model, accelerator=accelerator, args=args, loss_type=name, importance_sampling_level=level, beta=beta,
        epsilon_low=0.2, epsilon_high=0.28, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=corrected, vllm_importance_sampling_correction=corrected, current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    cls = trl_grpo.GRPOTrainer
    trainer._get_per_token_logps_and_entropies = cls._get_per_token_logps_and_entropies.__get__(trainer)
    trainer._compute_loss = cls._compute_loss.__get__(trainer)
    return trainer


def our_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor], loss_type: str, beta: float,
             correction: SamplerCorrection | None = None) -> dict[str, torch.Tensor]:
    """shardtune's loss of the batch, computed group by group (N completions each) as the objective computes it,
    with the step's denominator for the loss type (and, with ``correction``, the sampler's ratio from the injected
    sampler log-probabilities); backward on ``model``."""
    s = GrpoSettings(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28, temperature=TEMPERATURE)
    mask = inputs["completion_mask"]
    denominator = {"dapo": mask.sum(), "dr_grpo": B * MAX_LEN}.get(loss_type, B)
    total, kl_sum, low, high, all_logps = 0.0, 0.0, 0.0, 0.0, []
    for start in range(0, B, N):
        rows = {k: v[start:start + N] for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        logps = our_logps(model, rows)
        old = rows.get("old_per_token_logps", logps.detach())
        sampler = None if correction is None else sampler_ratio(
            correction, old, rows["sampling_per_token_logps"], rows["completion_mask"])
        terms = token_terms(s, logps, old, rows["advantages"], rows["completion_mask"],
                            rows.get("ref_per_token_logps"), sampler)
        total = total + aggregate(loss_type, terms.loss, rows["completion_mask"], denominator)
        if terms.kl is not None:
            kl_sum += float((terms.kl * rows["completion_mask"]).sum())
        lo, hi = clip_fractions(s, terms.ratio, rows["advantages"], rows["completion_mask"])
        low, high = low + float(lo), high + float(hi)
        all_logps.append(logps.detach())
    total.backward()
    tokens = float(mask.sum())
    return {"loss": total.detach(), "logps": torch.cat(all_logps), "kl": kl_sum / tokens, "low": low / tokens,
            "high": high / tokens}


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("off_policy", [False, True], ids=["num_iterations1", "num_iterations2"])
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["beta0", "beta0.04"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_loss_kl_and_gradients_equal_trls(loss_type, beta, off_policy):
    ours_model = tiny_llama()
    trl_model = copy.deepcopy(ours_model)
    trl_utils.add_fused_lm_head(trl_model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    inputs = injected(ours_model, off_policy, beta)
    trainer = trl_trainer(trl_model, loss_type, beta)
    trl_loss = trainer._compute_loss(trl_model, inputs)
    trl_loss.backward()
    with torch.no_grad():
        trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trl_model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), L)
    ours = our_step(ours_model, inputs, loss_type, beta)
    mask = inputs["completion_mask"].bool()
    assert abs(float(ours["loss"]) - float(trl_loss.detach())) <= TOLERANCE
    assert (ours["logps"][mask] - trl_logps[mask]).abs().max() <= TOLERANCE
    metrics = trainer._metrics["train"]
    if beta:
        assert abs(ours["kl"] - metrics["kl"][0]) <= TOLERANCE
    if loss_type != "gspo":  # TRL's token-level clip metrics (gspo's are per sequence)
        assert abs(ours["low"] - metrics["clip_ratio/low_mean"][0]) <= TOLERANCE
        assert abs(ours["high"] - metrics["clip_ratio/high_mean"][0]) <= TOLERANCE
    expected, found = gradients(trl_model), gradients(ours_model)
    assert expected.keys() == found.keys() and expected
    worst = max(float((found[k] - expected[k]).abs().max()) for k in expected)
    assert worst <= TOLERANCE, worst
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-4  # the step moves the weights


def test_group_advantages_equal_trls_normalisation():
    """Group std (unbiased, + 1e-4) as TRL's nanstd; batch std over the whole step; none: centred only."""
    rewards = torch.tensor([1.0, 0.0, 2.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    grouped = rewards.view(-1, 4)
    mean = grouped.mean(1).repeat_interleave(4)
    group_std = trl_utils.nanstd(grouped, dim=1).repeat_interleave(4)
    assert torch.allclose(group_advantages(rewards, 4, "group"), (rewards - mean) / (group_std + 1e-4), atol=1e-7)
    batch_std = trl_utils.nanstd(rewards)
    assert torch.allclose(group_advantages(rewards, 4, "batch", batch_std), (rewards - mean) / (batch_std + 1e-4),
                          atol=1e-7)
    assert torch.equal(group_advantages(rewards, 4, "none"), rewards - mean)
    assert torch.equal(group_advantages(rewards, 4, "group")[4:], torch.zeros(4))  # equal rewards: no signal


# --- the importance-sampling correction of a generator with weights of its own (TRL's vllm_importance_sampling_*) ---
def trl_sampler_ratio(mode: str, clip_min: float | None, clip_max: float | None, old: torch.Tensor,
                      sampled: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's own lines that compute the ratio (inline in ``_generate_and_score_completions``, no function of their
    own), cut from its source and run on the injected tensors."""
    source = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions)
    start = source.index("if self.use_vllm and self.vllm_importance_sampling_correction:\n")
    start = source.rindex("\n", 0, start) + 1
    end = source.index("# Compute the per-token log probabilities for the reference model", start)
    settings = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                               vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                               vllm_importance_sampling_clip_max=clip_max)
    scope = {"self": settings, "old_per_token_logps": old, "sampling_per_token_logps": sampled,
             "completion_mask": mask, "tool_mask": None, "torch": torch, "math": math}
    exec(textwrap.dedent(source[start:end].rstrip() + "\n"), scope)  # noqa: S102 - TRL's code, the oracle
    return scope["vllm_importance_sampling_ratio"]


def sampler_inputs(policy: torch.nn.Module, beta: float) -> dict[str, torch.Tensor]:
    """``injected``'s off-policy batch plus a sampler's log-probabilities from another copy, far enough from the
    trainer that ratios leave [0.5, 1.5] both ways, and one counted token the sampler could not score (NaN)."""
    inputs = injected(policy, off_policy=True, beta=beta)
    sampled = perturbed_logps(policy, inputs, seed=4, scale=0.05)
    sampled[1, 0] = float("nan")
    inputs["sampling_per_token_logps"] = sampled
    return inputs


MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@pytest.mark.parametrize("bounds", [(0.5, 1.5), (None, 1.5), (0.5, None)], ids=["both", "max", "min"])
@pytest.mark.parametrize("mode", MODES)
def test_the_sampler_ratio_equals_trls(mode, bounds):
    clip_min, clip_max = bounds
    if mode.endswith("truncate") and clip_max is None:
        clip_max = 3.0  # a truncation needs its upper bound in TRL (torch.clamp of None, None raises)
    inputs = sampler_inputs(tiny_llama(), beta=0.0)
    old, sampled, mask = inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], inputs["completion_mask"]
    expected = trl_sampler_ratio(mode, clip_min, clip_max, old, sampled, mask)
    ours = sampler_ratio(SamplerCorrection(mode, clip_min, clip_max), old, sampled, mask)
    assert ours.shape == expected.shape and torch.isfinite(ours).all()
    assert torch.equal(ours, expected)  # the same operations: bit for bit
    counted = ours[mask.bool()] if mode.startswith("token") else ours
    if mode.endswith("mask"):
        assert (counted == 0).any() and (counted > 0).any()  # the bounds bit: some ratios zeroed, some kept
    else:
        assert ((counted == clip_max) | (counted == (clip_min or -1))).any()  # some ratios clamped


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_the_corrected_loss_and_gradients_equal_trls(loss_type, mode):
    """TRL's _compute_loss with use_vllm and the correction on, fed TRL's own ratio; ours from the sampler's
    log-probabilities group by group (beta 0.04: the correction scales the surrogate, not the KL)."""
    ours_model = tiny_llama()
    trl_model = copy.deepcopy(ours_model)
    trl_utils.add_fused_lm_head(trl_model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    inputs = sampler_inputs(ours_model, beta=0.04)
    trl_inputs = dict(inputs, importance_sampling_ratio=trl_sampler_ratio(
        mode, 0.5, 1.5, inputs["old_per_token_logps"], inputs["sampling_per_token_logps"],
        inputs["completion_mask"]))
    trainer = trl_trainer(trl_model, loss_type, 0.04, corrected=True)
    trl_loss = trainer._compute_loss(trl_model, trl_inputs)
    trl_loss.backward()
    ours = our_step(ours_model, inputs, loss_type, 0.04, SamplerCorrection(mode, 0.5, 1.5))
    uncorrected = our_step(tiny_llama(), inputs, loss_type, 0.04)
    assert abs(float(ours["loss"]) - float(trl_loss.detach())) <= TOLERANCE
    assert abs(float(ours["loss"]) - float(uncorrected["loss"])) > 1e-3  # the correction changed the loss
    expected, found = gradients(trl_model), gradients(ours_model)
    worst = max(float((found[k] - expected[k]).abs().max()) for k in expected)
    assert worst <= TOLERANCE, worst
