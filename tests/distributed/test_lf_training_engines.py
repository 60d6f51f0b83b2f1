"""label_smoothing_factor, the DFT, EAFT and ASFT token losses and neftune_noise_alpha under the sharding engines,
2 processes on CPU.

The smoothed loss is computed inside the output layer's forward (the chunked loss), where FSDP and ZeRO-3 have
gathered the head's weight: the same losses as one process. NEFTune draws its noise per rank, so its runs are
checked for training (finite, falling loss), not for parity.
"""

from __future__ import annotations

import math

import pytest

from tests.distributed.helpers import ENGINE_KEYS, losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

SMOOTHED = ("label_smoothing_factor=0.1",)
ENGINES = {"fsdp2": ("fsdp=full_shard auto_wrap",), "zero3": ("deepspeed=z3",)}


@pytest.fixture(scope="module")
def smoothed_reference(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref-smoothed")
    train(tiny_model_dir, out, "full", 1, 4, *SMOOTHED)
    plain = tmp_path_factory.mktemp("ref-plain")
    train(tiny_model_dir, plain, "full", 1, 4)
    assert losses(out) != pytest.approx(losses(plain), rel=1e-4)  # the factor changes the loss
    return losses(out)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_label_smoothing_matches_one_process(engine, smoothed_reference, tiny_model_dir, tmp_path):
    train(tiny_model_dir, tmp_path, "full", 2, 2, *ENGINES[engine], *SMOOTHED)
    assert losses(tmp_path) == pytest.approx(smoothed_reference, rel=2e-3)


def test_neftune_trains_under_zero3(tiny_model_dir, tmp_path):
    train(tiny_model_dir, tmp_path, "lora", 2, 2, "deepspeed=z3", "neftune_noise_alpha=5", "max_steps=6")
    found = losses(tmp_path)
    assert all(math.isfinite(x) for x in found) and found[-1] < found[0]


# The token weightings (DFT; EAFT at alpha 2) are computed in the same place: one process against the sharding
# engines, LoRA under ZeRO-3 (its head is not sharded there, the gathered path is the full fine-tune's).
WEIGHTINGS = {"dft": ("use_dft_loss=true",), "eaft": ("use_eaft_loss=true", "eaft_alpha=2")}


@pytest.mark.parametrize(("weighting", "engine", "finetuning"), [
    ("eaft", "fsdp2", "full"),
    pytest.param("dft", "zero3", "full", marks=pytest.mark.matrix),
    pytest.param("eaft", "zero3", "lora", marks=pytest.mark.matrix),
])
def test_token_weighting_matches_one_process(weighting, engine, finetuning, tiny_model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train(tiny_model_dir, one, finetuning, 1, 4, *WEIGHTINGS[weighting])
    train(tiny_model_dir, two, finetuning, 2, 2, *ENGINES[engine], *WEIGHTINGS[weighting])
    assert losses(two) == pytest.approx(losses(one), rel=2e-3)


# ASFT (DFT plus asft_alpha x KL to the frozen reference): the reference scores every micro-batch first, a replica
# under DDP, sharded under ZeRO-3 and FSDP2, the adapters-off policy under LoRA. At the first step the policy is its
# reference (the KL is 0 up to rounding); after it the KL term is most of the loss.
ASFT = ("use_asft_loss=true", "asft_alpha=1")


@pytest.fixture(scope="module")
def asft_reference(tiny_model_dir, tmp_path_factory):
    found = {}
    for finetuning in ("full", "lora"):
        anchored, dft = tmp_path_factory.mktemp(f"asft-{finetuning}"), tmp_path_factory.mktemp(f"dft-{finetuning}")
        train(tiny_model_dir, anchored, finetuning, 1, 4, *ASFT)
        train(tiny_model_dir, dft, finetuning, 1, 4, *WEIGHTINGS["dft"])
        assert losses(anchored)[0] == pytest.approx(losses(dft)[0], rel=1e-3)
        assert losses(anchored)[1:] != pytest.approx(losses(dft)[1:], rel=1e-2), (losses(anchored), losses(dft))
        found[finetuning] = losses(anchored)
    return found


@pytest.mark.parametrize(("engine", "finetuning"), [
    ("ddp", "full"),
    ("zero3", "full"),
    pytest.param("fsdp2", "full", marks=pytest.mark.matrix),
    pytest.param("zero3", "lora", marks=pytest.mark.matrix),
])
def test_asft_matches_one_process(engine, finetuning, asft_reference, tiny_model_dir, tmp_path):
    train(tiny_model_dir, tmp_path, finetuning, 2, 2, *ENGINE_KEYS[engine], *ASFT)
    assert losses(tmp_path) == pytest.approx(asft_reference[finetuning], rel=2e-3)
