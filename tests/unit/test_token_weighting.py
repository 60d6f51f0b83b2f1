"""LLaMA-Factory's DFT and EAFT losses (use_dft_loss, use_eaft_loss + eaft_alpha): each token's cross entropy
scaled by a weight taken as a constant, on the chunked head and on the full logits alike (train/loss.py).

The references below are written from the definitions (LLaMA-Factory's dft_loss_func / eaft_loss_func: the target's
probability; the entropy of the 20 largest logits over 3, to the power alpha), through plain autograd in fp64.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardtune.train.loss import TokenWeighting, linear_cross_entropy_sum, plain_loss_sum
from tests.conftest import REPO, run_cli
from tests.unit.test_chunked_loss import VOCAB, random_head_inputs

M = -100


def reference_weighted_sum(logits: torch.Tensor, targets: torch.Tensor, weighting: TokenWeighting) -> torch.Tensor:
    kept = targets != M
    logits, targets = logits[kept], targets[kept]
    token_loss = F.cross_entropy(logits, targets, reduction="none")
    if weighting.kind == "dft":
        weights = torch.exp(-token_loss).detach()
    else:
        top = logits.detach().topk(20, dim=-1).values
        probs = torch.softmax(top, dim=-1)
        weights = ((-(probs * probs.log()).sum(-1)) / 3.0) ** weighting.alpha
    return (token_loss * weights).sum()


@pytest.mark.parametrize("weighting", [TokenWeighting("dft"), TokenWeighting("eaft", 1.0),
                                       TokenWeighting("eaft", 0.5)], ids=["dft", "eaft", "eaft-0.5"])
def test_the_chunked_head_matches_the_definition(weighting):
    hidden, weight, bias, targets = random_head_inputs()
    expected = reference_weighted_sum((hidden @ weight.t() + bias).reshape(-1, VOCAB), targets.reshape(-1),
                                      weighting)
    reference = torch.autograd.grad(expected * 0.37, (hidden, weight, bias))
    found = linear_cross_entropy_sum(hidden, weight, bias, targets, 4, weighting=weighting)
    assert found.item() == pytest.approx(expected.item(), rel=1e-12)
    for got, want in zip(torch.autograd.grad(found * 0.37, (hidden, weight, bias)), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    unweighted = linear_cross_entropy_sum(hidden, weight, bias, targets, 4)
    assert found.item() < unweighted.item()  # every weight is below 1 here


@pytest.mark.parametrize("weighting", [TokenWeighting("dft"), TokenWeighting("eaft", 2.0)], ids=["dft", "eaft"])
def test_the_full_logits_path_matches_the_definition(weighting):
    torch.manual_seed(1)
    logits = torch.randn(2, 7, VOCAB, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 7))
    labels[1, :2] = M
    found = plain_loss_sum(logits, labels, weighting=weighting)  # in fp32, as the plain path's logits.float()
    expected = reference_weighted_sum(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), weighting)
    assert float(found) == pytest.approx(float(expected), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(found, logits)[0], torch.autograd.grad(expected, logits)[0],
                               rtol=1e-5, atol=1e-7)


def train_losses(out, *keys: str) -> list[float]:
    result = run_cli("train", "examples/tiny/sft_full.yaml", f"output_dir={out}", "max_steps=3", "logging_steps=1",
                     "save_strategy=no", "do_eval=false", "eval_strategy=no", "val_size=0", "plot_loss=false",
                     "max_samples=24", *keys)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "trainer_log.jsonl").read_text().splitlines()
            if '"loss"' in line]


@pytest.mark.e2e
def test_dft_and_eaft_train_from_the_cli_and_change_the_loss(tmp_path):
    """The keys reach the loop: the logged loss is the weighted one (below the cross entropy, whose weights are 1),
    on the chunked head and on the full logits alike."""
    plain = train_losses(tmp_path / "plain")
    dft = train_losses(tmp_path / "dft", "use_dft_loss=true")
    full_logits = train_losses(tmp_path / "dft-full", "use_dft_loss=true", "loss_chunk_size=0")
    eaft = train_losses(tmp_path / "eaft", "use_eaft_loss=true", "eaft_alpha=2")
    assert all(d < p for d, p in zip(dft, plain, strict=True)) and dft[0] < 0.01 * plain[0]
    assert full_logits == pytest.approx(dft, rel=1e-4)
    assert eaft != pytest.approx(plain, rel=1e-3)


@pytest.mark.parametrize(("keys", "message"), [
    (["use_dft_loss=true", "use_eaft_loss=true"], "choose one"),
    (["use_dft_loss=true", "stage=dpo", "dataset=demo_dpo"], "stage dpo has its own loss"),
    (["use_eaft_loss=true", "label_smoothing_factor=0.1"], "remove one"),
    (["eaft_alpha=2"], "use_eaft_loss: true only"),
])
def test_contradictions_are_refused_before_launch(keys, message):
    result = run_cli("check", str(REPO / "examples" / "tiny" / "sft_lora.yaml"), *keys)
    assert result.returncode == 2 and message in result.stderr, result.stderr
