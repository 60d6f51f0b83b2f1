"""label_smoothing_factor and neftune_noise_alpha under the sharding engines, 2 processes on CPU.

The smoothed loss is computed inside the output layer's forward (the chunked loss), where FSDP and ZeRO-3 have
gathered the head's weight: the same losses as one process. NEFTune draws its noise per rank, so its runs are
checked for training (finite, falling loss), not for parity.
"""

from __future__ import annotations

import math

import pytest

from tests.distributed.helpers import losses, train

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
