"""report_to: tensorboard, wandb and mlflow are accepted when their package is installed; a missing one is refused
before launch with the line that installs it (never accepted and left unlogged)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from shardtune.config.load import build_config
from shardtune.launch.validate import cross_key_problems
from shardtune.train import trackers
from shardtune.train.reporting import Reporter

BASE = {"model_name_or_path": "m", "output_dir": "o", "dataset": "identity"}


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_tracker_package_is_refused_with_the_install_line(tracker, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name, *a: None if name == tracker else real(name, *a))
    problems = cross_key_problems(build_config({**BASE, "report_to": f"tensorboard,{tracker}"}))
    found = [p for p in problems if p.startswith(f"report_to ({tracker}): the {tracker} package is not installed")]
    assert found and f"pip install 'shardtune[{tracker}]'" in found[0], problems


@pytest.mark.parametrize("value", ["none", "tensorboard", "all", "wandb", "mlflow", "tensorboard,wandb,mlflow"])
def test_installed_trackers_are_accepted(value, monkeypatch):
    # What each needs besides its package: wandb a login unless offline, mlflow nothing without a server URI
    # (tests/unit/test_tracker_checks.py checks those).
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in trackers.wanted_trackers(value.split(",")):
        if name in trackers.OPTIONAL_TRACKERS:
            pytest.importorskip(trackers.OPTIONAL_TRACKERS[name][0])
    assert not [p for p in cross_key_problems(build_config({**BASE, "report_to": value})) if "report_to" in p]


def test_all_means_tensorboard_only():
    assert trackers.wanted_trackers(["all"]) == ["tensorboard"]
    assert trackers.wanted_trackers(["mlflow", "wandb", "tensorboard"]) == ["tensorboard", "wandb", "mlflow"]


def test_tensorboard_events_are_written(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    reporter = Reporter(tmp_path, 2, enabled=True, trackers=["tensorboard"], logging_dir=None, run_name="r",
                        config={"learning_rate": 0.001})
    reporter.log(1, 0.5, 1e-3, {"loss": 1.5})
    reporter.close()
    assert list((tmp_path / "runs").glob("events.out.tfevents.*"))


def test_mlflow_local_store_gets_every_logged_metric_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reporter = Reporter(tmp_path, 3, enabled=True, trackers=["mlflow"], logging_dir=None, run_name="unit",
                        config={"learning_rate": 0.001, "dataset": ["a", "b"]})
    for step, loss in ((1, 2.0), (2, 1.5), (3, 1.25)):
        reporter.log(step, step / 3, 1e-3, {"loss": loss, "grad_norm": 1.0, "tokens": 10.0})
    reporter.log_eval(3, 1.0, 1.75)
    reporter.close()
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("shardtune").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == \
        [(1, 2.0), (2, 1.5), (3, 1.25)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/loss")] == [1.75]
    assert run.data.params["learning_rate"] == "0.001" and json.loads(run.data.params["dataset"]) == ["a", "b"]
    assert run.info.run_name == "unit" and run.info.status == "FINISHED"
