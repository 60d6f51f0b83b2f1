"""LLaMA-Factory's ASFT loss (use_asft_loss + asft_alpha): DFT's weighted cross entropy plus asft_alpha times each
trainable token's KL(reference || policy) over the whole vocabulary, on the chunked head, on the full logits and
through a tiny model with its frozen reference (train/loss.py ``Anchor``, train/anchor.py).

The reference below is written from the definition (LLaMA-Factory's asft_loss_func: ``_dft_cross_entropy`` plus
``asft_alpha * F.kl_div(log_softmax(policy), softmax(reference)).sum(-1)``, both over the trainable positions),
through plain autograd in fp64; shardtune sums where LLaMA-Factory averages (the loop divides by the tokens).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardtune.train.loss import Anchor, TokenWeighting, causal_lm_loss_terms, linear_cross_entropy_sum, plain_loss_sum
from tests.conftest import REPO, run_cli
from tests.unit.test_chunked_loss import VOCAB, random_head_inputs, tiny_llama

M = -100
DFT = TokenWeighting("dft")


def asft_definition(logits: torch.Tensor, targets: torch.Tensor, ref_logits: torch.Tensor, alpha: float
                    ) -> torch.Tensor:
    """Summed DFT loss plus alpha x summed KL(reference || policy) over rows whose target is kept."""
    kept = targets != M
    logits, targets, ref_logits = logits[kept], targets[kept], ref_logits[kept]
    token_loss = F.cross_entropy(logits, targets, reduction="none")
    dft = (token_loss * torch.exp(-token_loss).detach()).sum()
    kl = F.kl_div(F.log_softmax(logits, dim=-1), F.softmax(ref_logits, dim=-1), reduction="none").sum(-1)
    return dft + alpha * kl.sum()


def anchor_of(ref_logits: torch.Tensor, targets: torch.Tensor, alpha: float) -> Anchor:
    return Anchor(ref_logits[targets != M].softmax(dim=-1), alpha)


@pytest.mark.parametrize("alpha", [0.1, 2.0])
def test_the_chunked_head_matches_the_definition(alpha):
    hidden, weight, bias, targets = random_head_inputs()
    flat_targets = targets.reshape(-1)
    ref_logits = torch.randn(flat_targets.numel(), VOCAB, dtype=torch.float64)
    expected = asft_definition((hidden @ weight.t() + bias).reshape(-1, VOCAB), flat_targets, ref_logits, alpha)
    wanted = torch.autograd.grad(expected * 0.37, (hidden, weight, bias))
    found = linear_cross_entropy_sum(hidden, weight, bias, targets, 4, weighting=DFT,
                                     anchor=anchor_of(ref_logits, flat_targets, alpha))
    assert found.item() == pytest.approx(expected.item(), rel=1e-12)
    for got, want in zip(torch.autograd.grad(found * 0.37, (hidden, weight, bias)), wanted, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    dft_only = linear_cross_entropy_sum(hidden, weight, bias, targets, 4, weighting=DFT)
    assert found.item() > dft_only.item()  # the KL of two different distributions is positive


def test_the_full_logits_path_matches_the_definition():
    torch.manual_seed(1)
    logits = torch.randn(2, 7, VOCAB, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 7))
    labels[1, :2] = M
    targets = labels[:, 1:].reshape(-1)
    ref_logits = torch.randn(targets.numel(), VOCAB, dtype=torch.float64)
    found = plain_loss_sum(logits, labels, weighting=DFT, anchor=anchor_of(ref_logits, targets, 0.5))
    expected = asft_definition(logits[:, :-1].reshape(-1, VOCAB), targets, ref_logits, 0.5)
    assert found.item() == pytest.approx(expected.item(), rel=1e-6)  # in fp32, as the plain path's logits.float()
    torch.testing.assert_close(torch.autograd.grad(found, logits)[0], torch.autograd.grad(expected, logits)[0],
                               rtol=1e-5, atol=1e-7)


def test_an_anchor_to_the_policy_itself_adds_nothing():
    """KL(p || p) is 0 and so is its gradient: at the first step ASFT is DFT."""
    hidden, weight, bias, targets = random_head_inputs()
    flat = targets.reshape(-1)
    same = (hidden @ weight.t() + bias).reshape(-1, VOCAB).detach()
    anchored = linear_cross_entropy_sum(hidden, weight, bias, targets, 5, weighting=DFT,
                                        anchor=anchor_of(same, flat, 1.0))
    grads = torch.autograd.grad(anchored, (hidden, weight, bias))
    dft = linear_cross_entropy_sum(hidden, weight, bias, targets, 5, weighting=DFT)
    assert anchored.item() == pytest.approx(dft.item(), rel=1e-12)
    for got, want in zip(grads, torch.autograd.grad(dft, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [0, 3])
def test_a_tiny_model_with_its_reference_matches_the_definition(chunk_size):
    """Through a model's forward (the chunked head inside the output layer, or the full logits): the loss and every
    parameter's gradient against autograd through the model's own logits, in fp64."""
    policy, reference = tiny_llama(seed=0).double(), tiny_llama(seed=1).double()
    torch.manual_seed(2)
    input_ids = torch.randint(0, VOCAB, (2, 8))
    labels = input_ids.clone()
    labels[0, :3] = M
    labels[1, 6:] = M
    targets = labels[:, 1:].reshape(-1)
    with torch.no_grad():
        ref_logits = reference(input_ids=input_ids).logits[:, :-1].reshape(-1, VOCAB)
    expected = asft_definition(policy(input_ids=input_ids).logits[:, :-1].reshape(-1, VOCAB), targets, ref_logits,
                               0.3)
    params = [p for p in policy.parameters() if p.requires_grad]
    wanted = torch.autograd.grad(expected, params)
    found, _ = causal_lm_loss_terms(policy, {"input_ids": input_ids}, labels, chunk_size, weighting=DFT,
                                    anchor=anchor_of(ref_logits, targets, 0.3))
    assert found.item() == pytest.approx(expected.item(), rel=1e-6 if chunk_size == 0 else 1e-10)
    tolerance = {"rtol": 1e-3, "atol": 1e-6} if chunk_size == 0 else {"rtol": 1e-8, "atol": 1e-10}  # fp32 / fp64
    for got, want in zip(torch.autograd.grad(found, params), wanted, strict=True):
        torch.testing.assert_close(got, want, **tolerance)


def test_an_anchor_with_rows_for_other_positions_is_refused():
    hidden, weight, bias, targets = random_head_inputs()
    with pytest.raises(RuntimeError, match="rows for"):
        linear_cross_entropy_sum(hidden, weight, bias, targets, 4, weighting=DFT,
                                 anchor=Anchor(torch.zeros(3, VOCAB, dtype=torch.float64), 0.1))


def test_the_plain_loss_is_unchanged_without_an_anchor():
    torch.manual_seed(3)
    logits = torch.randn(1, 5, VOCAB)
    labels = torch.randint(0, VOCAB, (1, 5))
    assert torch.equal(plain_loss_sum(logits, labels), F.cross_entropy(logits[0, :-1], labels[0, 1:],
                                                                       reduction="sum"))


def logged_losses(out, *keys: str) -> list[float]:
    result = run_cli("train", "examples/tiny/sft_full.yaml", f"output_dir={out}", "max_steps=3", "logging_steps=1",
                     "save_strategy=no", "do_eval=false", "eval_strategy=no", "val_size=0", "plot_loss=false",
                     "max_samples=24", "learning_rate=1e-3", *keys)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "trainer_log.jsonl").read_text().splitlines()
            if '"loss"' in line]


@pytest.mark.e2e
@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_asft_trains_from_the_cli_anchored_to_the_model_as_loaded(tmp_path, finetuning):
    """The first step's policy is its reference (DFT's loss); after it the KL term changes the loss, the same on the
    chunked head and on the full logits; a frozen copy (full) or the adapters-off policy (lora) is the reference."""
    dft = logged_losses(tmp_path / "dft", f"finetuning_type={finetuning}", "use_dft_loss=true")
    asft = logged_losses(tmp_path / "asft", f"finetuning_type={finetuning}", "use_asft_loss=true", "asft_alpha=1")
    full_logits = logged_losses(tmp_path / "full-logits", f"finetuning_type={finetuning}", "use_asft_loss=true",
                                "asft_alpha=1", "loss_chunk_size=0")
    assert asft[0] == pytest.approx(dft[0], rel=1e-3)
    assert asft[1:] != pytest.approx(dft[1:], rel=1e-2), (asft, dft)
    assert full_logits == pytest.approx(asft, rel=1e-3)


@pytest.mark.parametrize(("keys", "message"), [
    (["use_asft_loss=true", "use_dft_loss=true"], "use_dft_loss (true) and use_asft_loss (true) each reweight"),
    (["use_asft_loss=true", "stage=dpo", "dataset=demo_dpo"], "stage dpo has its own loss"),
    (["use_asft_loss=true", "label_smoothing_factor=0.1"], "remove one"),
    (["asft_alpha=0.5"], "asft_alpha (0.5) is read with use_asft_loss: true only"),
    (["asft_alpha=-1", "use_asft_loss=true"], "asft_alpha"),
    (["use_asft_loss=true", "neftune_noise_alpha=5"], "embeddings would get the noise too"),
    (["use_asft_loss=true", "pissa_init=true"], "residual of the weights"),
    (["use_asft_loss=true", "precompute_ref_log_probs=true"], "precompute_ref_log_probs (true) is for stage dpo/kto"),
])
def test_combinations_that_cannot_work_are_refused_before_launch(keys, message):
    result = run_cli("check", str(REPO / "examples" / "tiny" / "sft_lora.yaml"), *keys)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_ref_model_is_read_with_asft_and_counted_as_a_copy():
    from shardtune.config.preference import holds_reference_copy
    from shardtune.config.schema import TrainConfig

    assert holds_reference_copy(TrainConfig(use_asft_loss=True, finetuning_type="full"))
    assert not holds_reference_copy(TrainConfig(use_asft_loss=True, finetuning_type="lora"))
    assert holds_reference_copy(TrainConfig(use_asft_loss=True, finetuning_type="lora", ref_model="/some/folder"))
    result = run_cli("check", str(REPO / "examples" / "tiny" / "sft_lora.yaml"), "ref_model=/no/such/folder")
    assert "is read by stage dpo (a loss with a reference), kto or use_asft_loss only" in result.stderr
