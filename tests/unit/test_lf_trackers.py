"""report_to: wandb / mlflow are refused before launch with the reason, never accepted and left unlogged."""

from __future__ import annotations

import pytest

from shardtune.config.load import build_config
from shardtune.launch.validate import cross_key_problems
from shardtune.train.reporting import Reporter

BASE = {"model_name_or_path": "m", "output_dir": "o", "dataset": "identity"}


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_shardtune_does_not_write_to_is_refused_with_the_reason(tracker):
    problems = cross_key_problems(build_config({**BASE, "report_to": f"tensorboard,{tracker}"}))
    assert [p for p in problems if p.startswith(f"report_to ({tracker}): shardtune does not send metrics")]
    assert "report_to: tensorboard" in " ".join(problems)


def test_tensorboard_and_none_are_accepted():
    for value in ("none", "tensorboard", "all"):
        assert not [p for p in cross_key_problems(build_config({**BASE, "report_to": value})) if "report_to" in p]


def test_tensorboard_events_are_written(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    reporter = Reporter(tmp_path, 2, enabled=True, trackers=["tensorboard"], logging_dir=None, run_name="r")
    reporter.log(1, 0.5, 1e-3, {"loss": 1.5})
    reporter.close()
    assert list((tmp_path / "runs").glob("events.out.tfevents.*"))
