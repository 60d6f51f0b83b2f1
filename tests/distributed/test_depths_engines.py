"""Mixture of depths (model/depths.py) on two processes equals one: each row's token budget is its own share, so a
row is routed the same in any batch. The saved folder routes again with ``mixture_of_depths: load``."""

from __future__ import annotations

import json

import pytest

from tests.distributed.helpers import ENGINE_KEYS, losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROUTED = ("mixture_of_depths=convert",)


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mod-ref")
    train(tiny_model_dir, out, "full", 1, 4, *ROUTED)
    return out


@pytest.mark.parametrize("engine", ["ddp", "zero2"])
def test_two_processes_route_and_train_as_one(engine, tiny_model_dir, one_process, tmp_path):
    train(tiny_model_dir, tmp_path, "full", 2, 2, *ROUTED, *ENGINE_KEYS[engine])
    assert losses(tmp_path) == pytest.approx(losses(one_process), rel=2e-3)
    routed = json.loads((tmp_path / "config.json").read_text())["mixture_of_depths"]
    assert routed == {"capacity": 0.125, "layers": [1]}


def test_a_routed_run_trains_on_from_its_saved_folder(one_process, tmp_path):
    result = train(one_process, tmp_path, "full", 1, 4, "mixture_of_depths=load")
    assert result["global_step"] == 4
