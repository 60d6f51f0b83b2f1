"""build_tiny_model_if_missing builds only the demo's own kind of folder: never at a hub id, a real model's path
or into a folder that exists (a demo file pointed at a real model would otherwise train random weights)."""

from __future__ import annotations

import pytest

from shardtune.model.tiny import tiny_model_build_problem
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("name, refused_because", [
    ("meta-llama/Llama-3.2-1B", "reads as a hub id"),
    ("hf-internal-testing/tiny-random-LlamaForCausalLM", "reads as a hub id"),
    ("{tmp}/Llama-3-8B-Instruct", "contains 'tiny'"),
    ("{tmp}/exists", "has no config.json"),  # a folder that exists is read as the model, never built into
])
def test_train_builds_nothing_where_the_user_did_not_ask(name, refused_because, tmp_path):
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "notes.txt").write_text("mine")
    model = name.format(tmp=tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_cli("train", str(REPO / "examples/tiny/sft_lora.yaml"), f"model_name_or_path={model}",
                     f"dataset_dir={REPO / 'data'}", f"output_dir={tmp_path / 'out'}", "max_steps=1", cwd=tmp_path,
                     timeout=300)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert len(errors) == 1 and refused_because in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no model folder, no output_dir
    assert (tmp_path / "exists" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["models/tiny-llama", "./org/tiny-model", "{tmp}/a/tiny"])
def test_the_demo_kind_of_folder_may_be_built(name, tmp_path):
    assert tiny_model_build_problem(name.format(tmp=tmp_path)) is None


def test_a_folder_that_holds_a_model_is_read_not_built(tiny_model_dir):
    assert tiny_model_build_problem(str(tiny_model_dir)) is None
