"""`shardtune doctor` on one node: this node's facts, no network test."""

from __future__ import annotations

import re

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def test_doctor_on_one_node_prints_the_facts(tiny_model_dir, tmp_path):
    result = run_cli("doctor", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}",
                     f"output_dir={tmp_path}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^torch\s+\d+\.\d+", result.stdout, re.M)
    assert re.search(r"^config_hash\s+[0-9a-f]{12}$", result.stdout, re.M)
    assert "all-reduce: skipped, one node" in result.stdout


def test_doctor_names_a_missing_interface(tmp_path):
    result = run_cli("doctor", GLOO_SOCKET_IFNAME="nosuchif0", CUDA_VISIBLE_DEVICES="", timeout=300)
    assert result.returncode == 2
    assert "shardtune: error: GLOO_SOCKET_IFNAME=nosuchif0 names no interface of node 0" in result.stderr
