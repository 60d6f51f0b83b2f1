"""profile_steps through the real CLI: the profile lands in train_results.json and the run log."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_profile_steps_summarises_the_profiled_steps_and_leaves_them_out_of_the_throughput(tiny_model_dir,
                                                                                          tmp_path):
    out = tmp_path / "run"
    result = run_cli("train", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}",
                     f"output_dir={out}", "max_steps=6", "profile_steps=2", "save_strategy=no")
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "train_results.json").read_text())
    profile = results["profile"]
    assert profile["steps"] == 2 and profile["device_busy_fraction"] is None  # no accelerator here
    # The step reads its numbers from the device once (the reduction's .tolist()).
    assert profile["host_syncs_per_step"] >= 1
    assert any(o["name"].startswith("aten::") for o in profile["top_cpu_operators"])
    assert results["throughput"]["profiled_steps"] == 2
    assert results["throughput"]["measured_steps"] == 6 - 1 - 2  # minus the warm-up step and the profiled ones
    assert "[shardtune] profile of 2 steps" in result.stdout
