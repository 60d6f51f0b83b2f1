"""Packing, length grouping and the tokenised-dataset cache through the real CLI on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# Two small datasets, one epoch, a learning rate too small to change the model: every variant then
# measures the loss of the same model on the same trainable tokens.
FROZEN_EPOCH = ["max_samples=40", "num_train_epochs=1", "max_steps=-1", "learning_rate=1e-9", "val_size=0",
                "do_eval=false", "eval_strategy=no", "save_strategy=no", "plot_loss=false"]


def train(model: Path, out: Path, *overrides: str, config: str = "examples/tiny/sft_full.yaml") -> str:
    result = run_cli("train", config, f"model_name_or_path={model}", f"output_dir={out}", *overrides)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def throughput(out: Path) -> dict:
    return json.loads((out / "train_results.json").read_text())["throughput"]


def test_packed_grouped_and_padded_epochs_train_the_same_tokens(tiny_model_dir, tmp_path):
    runs = {}
    for name, extra in {"padded": ["packing=false", "padding_free=false"],
                        "grouped": ["packing=false", "padding_free=false", "group_by_length=true"],
                        "padding_free": ["packing=false", "padding_free=true"],
                        "packed": ["packing=true"]}.items():
        train(tiny_model_dir, tmp_path / name, *FROZEN_EPOCH, *extra)
        runs[name] = throughput(tmp_path / name)
    base = runs["padded"]["loss_per_token"]
    assert runs["packed"]["loss_per_token"] == pytest.approx(base, rel=1e-5)
    assert runs["grouped"]["loss_per_token"] == pytest.approx(base, rel=1e-5)
    assert runs["padding_free"]["loss_per_token"] == pytest.approx(base, rel=1e-5)
    padding = {name: tp["padding_fraction"] for name, tp in runs.items()}
    assert padding["packed"] < 0.1, padding
    # padding_free fills rows no longer than the micro-batch's longest sample: fewer rows, not none padded
    assert padding["grouped"] < padding["padded"] / 2 and padding["padding_free"] < padding["padded"] / 2, padding
    for tp in runs.values():
        assert tp["effective_tokens_per_second"] > 0 and tp["step_time_median_seconds"] > 0
        assert tp["first_step_unix_time"] > 0 and tp["measured_steps"] >= 1


def no_dataset_config(tmp_path: Path) -> Path:
    config = yaml.safe_load((REPO / "examples/tiny/sft_lora.yaml").read_text())
    del config["dataset"]
    path = tmp_path / "from_cache.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_tokenized_path_is_built_once_reused_and_rebuilt_when_inputs_change(tiny_model_dir, tmp_path):
    cache = tmp_path / "tokenized"
    quick = ["max_steps=2", "val_size=0", "do_eval=false", "eval_strategy=no", "save_strategy=no", "plot_loss=false",
             f"tokenized_path={cache}"]
    first = train(tiny_model_dir, tmp_path / "a", *quick)
    assert "tokenising into" in first and (cache / "shardtune_data.json").is_file()
    assert not list(tmp_path.glob(".tokenized.*")), "temporary folders left behind"

    again = train(tiny_model_dir, tmp_path / "b", *quick)
    assert "tokenising into" not in again
    assert json.loads((tmp_path / "b/train_results.json").read_text())["train_loss"] == pytest.approx(
        json.loads((tmp_path / "a/train_results.json").read_text())["train_loss"], rel=1e-6)

    changed = train(tiny_model_dir, tmp_path / "c", *quick, "cutoff_len=128")
    assert "tokenising into" in changed
    assert json.loads((cache / "shardtune_data.json").read_text())["settings"]["cutoff_len"] == 128

    # No dataset configured: the prepared folder alone is enough (LLaMA-Factory's tokenized_path use).
    alone = train(tiny_model_dir, tmp_path / "d", "max_steps=2", "save_strategy=no", "plot_loss=false",
                  f"tokenized_path={cache}", config=str(no_dataset_config(tmp_path)))
    assert "tokenising into" not in alone


def test_missing_dataset_without_a_prepared_tokenized_path_is_a_config_error(tiny_model_dir, tmp_path):
    result = run_cli("train", str(no_dataset_config(tmp_path)), f"model_name_or_path={tiny_model_dir}",
                     f"output_dir={tmp_path / 'out'}", f"tokenized_path={tmp_path / 'nothing'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "dataset is required" in result.stderr and "tokenized_path" in result.stderr


class NodeView:
    """What prepare_tokenized asks of an engine: who this rank is; barriers are no-ops in one process."""

    def __init__(self, rank: int, local_rank: int) -> None:
        self.rank, self.local_rank, self.is_main = rank, local_rank, rank == 0

    def barrier(self) -> None:
        pass


def test_a_node_that_cannot_see_rank_0s_tokenized_path_builds_its_own(tiny_model_dir, tmp_path, monkeypatch):
    from shardtune.config.load import build_config
    from shardtune.model.load import load_tokenizer
    from shardtune.train.setup import prepare_tokenized

    monkeypatch.chdir(REPO)
    values = {**yaml.safe_load((REPO / "examples/tiny/sft_lora.yaml").read_text()), "val_size": 0,
              "do_eval": False, "eval_strategy": "no", "model_name_or_path": str(tiny_model_dir)}
    tokenizer = load_tokenizer(str(tiny_model_dir))
    node0 = build_config({**values, "tokenized_path": str(tmp_path / "node0" / "tok")}, "test")
    node1 = build_config({**values, "tokenized_path": str(tmp_path / "node1" / "tok")}, "test")
    train0, _ = prepare_tokenized(tokenizer, node0, NodeView(rank=0, local_rank=0))
    # Rank 2 is the first rank of the second node; its filesystem does not have node 0's folder.
    train1, _ = prepare_tokenized(tokenizer, node1, NodeView(rank=2, local_rank=0))
    assert (tmp_path / "node1" / "tok" / "shardtune_data.json").is_file()
    assert train1["input_ids"] == train0["input_ids"]
    # Rank 3 (same node, local rank 1) only loads.
    before = (tmp_path / "node1" / "tok" / "shardtune_data.json").stat().st_mtime_ns
    prepare_tokenized(tokenizer, node1, NodeView(rank=3, local_rank=1))
    assert (tmp_path / "node1" / "tok" / "shardtune_data.json").stat().st_mtime_ns == before
