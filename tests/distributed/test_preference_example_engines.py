"""The LLaMA-Factory-style DPO YAML (`stage: dpo`, `pref_beta`, `pref_loss`, the bundled `demo_dpo` pairs named in
data/dataset_info.json) through the CLI under `FORCE_TORCHRUN=1 NPROC_PER_NODE=2`, once per engine: it trains on 2
ranks and learns the pairs (reward accuracy above chance, the loss below log 2, the untrained policy's value)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import ENGINE_KEYS
from tests.e2e.test_train_cli import read_log

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

DPO = "examples/tiny/dpo_lora.yaml"


@pytest.mark.parametrize("engine", list(ENGINE_KEYS))
def test_llamafactory_style_dpo_yaml_learns_the_pairs_on_two_processes(engine, tiny_model_dir, tmp_path):
    out = tmp_path / engine
    result = run_cli("train", DPO, f"model_name_or_path={tiny_model_dir}", f"output_dir={out}", "save_strategy=no",
                     "plot_loss=false", *ENGINE_KEYS[engine], FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert json.loads((out / "train_results.json").read_text())["world_size"] == 2
    records = [r for r in read_log(out) if "loss" in r]
    last = records[-3:]  # the last 6 of 12 steps (logging_steps: 2)
    assert sum(r["rewards/accuracies"] for r in last) / len(last) > 0.5, records
    assert records[-1]["loss"] < math.log(2) and records[-1]["rewards/margins"] > 0, records
