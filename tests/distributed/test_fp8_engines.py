"""fp8 (torchao float8 layers) under DeepSpeed ZeRO-3 and FSDP2 with the float8 all-gather, 2 gloo processes: the
losses of one process with the same float8 layers, and FSDP2's scales precomputed after each step. Runs where
torchao is installed (torch 2.13 runs float8 matmuls on the CPU); a rank's CLI still refuses fp8 without a float8
GPU, so the worker builds the engines itself (tests/distributed/fp8_worker.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.distributed.test_deepspeed_engine import run_worker

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                 reason="torchao is not installed (pip install 'shardtune[fp8]')")]
WORKER = Path(__file__).resolve().parent / "fp8_worker.py"
# Each rank scales its own half of a batch (one dynamic scale per tensor), the single process the whole batch:
# float8's rounding then differs slightly; a lost micro-batch or a layer computing garbage moves the loss by far more.
RTOL = 1e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("fp8")
    run_worker([sys.executable, str(WORKER), "--out", str(out), "--reference"], timeout=120)
    run_worker([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
                "--out", str(out)], timeout=280)
    return json.loads((out / "reference.json").read_text()), json.loads((out / "engines.json").read_text())


@pytest.mark.parametrize("engine", ["z3", "fsdp2_all_gather"])
def test_float8_layers_train_as_on_one_process(runs, engine):
    reference, results = runs
    got, expected = results[engine]["metrics"], reference["metrics"]
    assert results[engine]["converted"] == reference["converted"] == 14  # 7 projections x 2 layers; head kept
    assert [m["trainable_tokens"] for m in got] == [m["trainable_tokens"] for m in expected]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in expected], rel=RTOL)
    assert got[0]["loss"] != pytest.approx(got[-1]["loss"], rel=1e-4)  # the steps moved the weights


def test_fsdp2_precomputes_the_float8_scales_after_each_step(runs):
    _, results = runs
    assert results["fsdp2_all_gather"]["precomputes_scales"] is True
    assert results["fsdp2_all_gather"]["scales_precomputed"] is True
