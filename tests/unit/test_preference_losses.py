"""The preference losses against TRL (trl==1.16.0, a test-only dependency), the independent implementation.

Where TRL has a loss as a method that needs only a few attributes (CPO's ``cpo_loss``, ORPO's
``odds_ratio_loss``) it is called on an object made with ``object.__new__``. TRL 1.16's DPO and KTO losses live
inside ``_compute_loss``, which runs the model: it is called the same way on a tiny random LLaMA patched with TRL's
``add_fused_lm_head`` (reference log-probabilities given as precomputed), and ours runs on the same model's logits,
so the response log-probability sums are checked too. The accelerator is replaced by a one-process identity for
its gather calls. The reward model's pairwise loss is TRL's ``RewardTrainer.compute_loss`` on a tiny
sequence-classification model.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from shardtune.train.preference import (
    PairLogps,
    PreferenceSettings,
    kto_kl_estimate,
    kto_losses,
    pairwise_reward_loss,
    preference_loss,
    sequence_logps,
)

trl = pytest.importorskip("trl")
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402
from trl.trainer.reward_trainer import RewardTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

TOL = 1e-6
ONE_PROCESS = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)


def random_pairs(n: int = 6, seed: int = 0) -> tuple[PairLogps, PairLogps]:
    g = torch.Generator().manual_seed(seed)
    lengths_c = torch.randint(1, 12, (n,), generator=g)
    lengths_r = torch.randint(1, 12, (n,), generator=g)
    # Summed log-probabilities: negative, about -2 per token, different for policy and reference.
    def logps(lengths: torch.Tensor) -> torch.Tensor:
        return -(torch.rand(n, generator=g, dtype=torch.float64) * 3 + 0.2) * lengths
    policy = PairLogps(logps(lengths_c), logps(lengths_r), lengths_c, lengths_r)
    reference = PairLogps(logps(lengths_c), logps(lengths_r), lengths_c, lengths_r)
    return policy, reference


def cpo(loss_type: str, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> CPOTrainer:
    trainer = object.__new__(CPOTrainer)
    trainer.__dict__.update(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma,
                            alpha=0.0, accelerator=ONE_PROCESS)
    return trainer


@pytest.mark.parametrize("loss,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0)])
def test_dpo_family_matches_trl_on_log_ratios(loss: str, smoothing: float) -> None:
    # CPO's loss is DPO's without a reference: given the log-ratios (policy - reference) as its log-probabilities
    # it is DPO's loss with TRL's (and LLaMA-Factory's) conservative label smoothing.
    policy, reference = random_pairs()
    s = PreferenceSettings(loss=loss, beta=0.3, label_smoothing=smoothing)
    ours = preference_loss(s, policy, reference)
    if s.averages_lengths:
        policy, reference = policy.averaged(), reference.averaged()
    trl_losses, trl_chosen, trl_rejected = cpo(loss, 0.3, smoothing).cpo_loss(
        policy.chosen - reference.chosen, policy.rejected - reference.rejected)
    torch.testing.assert_close(ours.losses, trl_losses, atol=TOL, rtol=0, check_dtype=False)
    torch.testing.assert_close(ours.metrics["rewards/chosen"], trl_chosen, atol=TOL, rtol=0, check_dtype=False)
    torch.testing.assert_close(ours.metrics["rewards/rejected"], trl_rejected, atol=TOL, rtol=0, check_dtype=False)


def test_simpo_matches_trl() -> None:
    policy, _ = random_pairs(seed=1)
    s = PreferenceSettings(loss="simpo", beta=2.0, simpo_gamma=0.7)
    ours = preference_loss(s, policy, None)
    averaged = policy.averaged()
    trl_losses, trl_chosen, trl_rejected = cpo("simpo", 2.0, simpo_gamma=0.7).cpo_loss(averaged.chosen,
                                                                                         averaged.rejected)
    torch.testing.assert_close(ours.losses, trl_losses, atol=TOL, rtol=0, check_dtype=False)
    torch.testing.assert_close(ours.metrics["rewards/chosen"], trl_chosen, atol=TOL, rtol=0, check_dtype=False)
    torch.testing.assert_close(ours.metrics["rewards/rejected"], trl_rejected, atol=TOL, rtol=0, check_dtype=False)


def test_orpo_matches_trl() -> None:
    policy, _ = random_pairs(seed=2)
    s = PreferenceSettings(loss="orpo", beta=0.25)
    ours = preference_loss(s, policy, None)
    trainer = object.__new__(ORPOTrainer)
    trainer.__dict__.update(beta=0.25, accelerator=ONE_PROCESS)
    averaged = policy.averaged()
    ratio_term, trl_chosen, trl_rejected, _, _ = trainer.odds_ratio_loss(averaged.chosen, averaged.rejected)
    # TRL's ORPOTrainer: loss = NLL(chosen) - beta * log sigmoid(log odds); the NLL is the averaged one here.
    torch.testing.assert_close(ours.losses, -averaged.chosen - ratio_term, atol=TOL, rtol=0, check_dtype=False)
    torch.testing.assert_close(ours.metrics["rewards/chosen"], trl_chosen, atol=TOL, rtol=0, check_dtype=False)
    torch.testing.assert_close(ours.metrics["rewards/rejected"], trl_rejected, atol=TOL, rtol=0, check_dtype=False)


def test_pref_ftx_adds_the_chosen_average_nll() -> None:
    policy, reference = random_pairs(seed=3)
    plain = preference_loss(PreferenceSettings(beta=0.1), policy, reference)
    with_ftx = preference_loss(PreferenceSettings(beta=0.1, ftx=0.5), policy, reference)
    torch.testing.assert_close(with_ftx.losses - plain.losses, 0.5 * -policy.chosen / policy.chosen_lengths)


def test_reference_must_match_the_loss() -> None:
    policy, reference = random_pairs()
    with pytest.raises(ValueError, match="missing"):
        preference_loss(PreferenceSettings(loss="sigmoid"), policy, None)
    with pytest.raises(ValueError, match="given"):
        preference_loss(PreferenceSettings(loss="simpo"), policy, reference)


# --- through a model: TRL's DPO and KTO trainers' loss code ---

def tiny_causal_lm(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).float().train()


def pair_batch(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows: a prompt (mask 0), a response (mask 1), padding (attention 0)."""
    g = torch.Generator().manual_seed(seed)
    width = 14
    input_ids = torch.randint(1, 48, (rows, width), generator=g)
    attention = torch.zeros(rows, width, dtype=torch.long)
    completion = torch.zeros(rows, width, dtype=torch.long)
    for i in range(rows):
        prompt, total = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(8, width + 1, (1,), generator=g))
        attention[i, :total] = 1
        completion[i, prompt:total] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


def our_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return sequence_logps(logits, labels)


@pytest.mark.parametrize("loss", ["sigmoid", "hinge", "ipo"])
def test_dpo_through_a_model_matches_trl_dpo_trainer(loss: str) -> None:
    model = tiny_causal_lm()
    batch = pair_batch(rows=6)  # 3 chosen rows, then their 3 rejected rows, as both batch them
    ref_summed = -torch.rand(6) * 20
    with torch.no_grad():
        summed, lengths = our_logps(model, batch)
    n = 3
    s = PreferenceSettings(loss=loss, beta=0.2)
    ours = preference_loss(s, PairLogps(summed[:n], summed[n:], lengths[:n], lengths[n:]),
                           PairLogps(ref_summed[:n], ref_summed[n:], lengths[:n], lengths[n:]))

    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    trainer = object.__new__(DPOTrainer)
    trainer.__dict__.update(model=model, accelerator=ONE_PROCESS, aux_loss_enabled=False, ld_alpha=None,
                            precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss],
                            loss_weights=[1.0], beta=0.2, use_weighting=False, label_smoothing=0.0,
                            _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    with torch.no_grad():
        trl_loss = trainer._compute_loss(model, {**batch, "ref_chosen_logps": ref_summed[:n],
                                                 "ref_rejected_logps": ref_summed[n:]}, False)
    trl_metrics = trainer._metrics["train"]
    assert abs(float(ours.losses.mean()) - float(trl_loss)) < TOL
    if s.averages_lengths:
        # TRL logs IPO's rewards and log-probabilities from the summed log-probabilities; LLaMA-Factory (and we)
        # from the averaged ones the loss uses: only the loss is comparable.
        return
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert abs(float(ours.metrics[key].mean()) - trl_metrics[key][-1]) < TOL, key
    for key in ("logps/chosen", "logps/rejected"):
        assert abs(float(ours.metrics[key].mean()) - trl_metrics[key][-1]) < 1e-5, key


def test_kto_through_a_model_matches_trl_kto_trainer() -> None:
    model = tiny_causal_lm(seed=1)
    batch = pair_batch(rows=5, seed=1)
    kl_batch = pair_batch(rows=5, seed=2)  # (prompt, another example's answer): KTO's KL estimate
    desirable = torch.tensor([True, False, True, True, False])
    with torch.no_grad():
        logps, _ = our_logps(model, batch)
        kl_logps, _ = our_logps(model, kl_batch)
    g = torch.Generator().manual_seed(5)
    ref_logps = logps + torch.randn(5, generator=g)
    ref_kl_logps = kl_logps - torch.rand(5, generator=g) * 2  # a positive KL estimate, about 1
    s = PreferenceSettings(beta=0.3, kto_chosen_weight=1.5, kto_rejected_weight=0.7)
    kl = kto_kl_estimate(kl_logps, ref_kl_logps).clamp(min=0)
    ours = kto_losses(s, logps, ref_logps, desirable, kl)

    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    trainer = object.__new__(KTOTrainer)
    trainer.__dict__.update(model=model, accelerator=ONE_PROCESS, aux_loss_enabled=False, calculate_KL=True,
                            precompute_ref_logps=True, loss_type="kto", beta=0.3, desirable_weight=1.5,
                            undesirable_weight=0.7, _metrics=defaultdict(lambda: defaultdict(list)),
                            _total_train_tokens=0, _tp_size=1)
    inputs = {**batch, "label": desirable, "KL_input_ids": kl_batch["input_ids"],
              "KL_attention_mask": kl_batch["attention_mask"], "KL_completion_mask": kl_batch["completion_mask"],
              "ref_logps": ref_logps, "ref_KL_logps": ref_kl_logps}
    with torch.no_grad():
        trl_loss = trainer._compute_loss(model, inputs, False)
    trl_metrics = trainer._metrics["train"]
    assert float(kl) > 0, "the test must exercise a positive KL estimate"
    assert abs(float(ours.losses.mean()) - float(trl_loss)) < TOL
    assert abs(float(kl) - trl_metrics["kl"][-1]) < TOL
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert abs(float(ours.metrics[key].mean()) - trl_metrics[key][-1]) < 1e-5, key


def test_reward_loss_matches_trl_reward_trainer() -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    model = LlamaForSequenceClassification(config).train()
    batch = pair_batch(rows=6, seed=4)
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        scores = model(**inputs).logits.squeeze(-1)
        ours = pairwise_reward_loss(scores[:3], scores[3:])
        trainer = object.__new__(RewardTrainer)
        trainer.__dict__.update(model=model, accelerator=ONE_PROCESS, args=SimpleNamespace(
            center_rewards_coefficient=None), _metrics=defaultdict(lambda: defaultdict(list)),
            _total_train_tokens=0, _tp_size=1)
        trl_loss = trainer.compute_loss(model, dict(inputs))
    assert abs(float(ours.losses.mean()) - float(trl_loss)) < TOL
    assert abs(float(ours.metrics["rewards/accuracies"].mean()) - trainer._metrics["train"]["accuracy"][-1]) < TOL
    assert abs(float(ours.metrics["rewards/margins"].mean()) - trainer._metrics["train"]["margin"][-1]) < TOL
