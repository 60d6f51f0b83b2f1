"""Stopping on a scheduler's request: exit codes, a job stopped from another node, a requeued job resumes."""

from __future__ import annotations

import json
import time

import pytest

from shardtune.config.load import build_config
from shardtune.launch.preemption import INTERRUPTED_EXIT_CODE, REQUEUE_EXIT_CODE, exit_code_for, warning_seconds
from shardtune.launch.preflight import continued_when_requeued
from shardtune.launch.supervise import stopped_elsewhere
from shardtune.train.rank_log import rank_log_path


def test_a_person_stops_with_130_a_scheduler_with_the_requeue_code():
    assert exit_code_for("SIGINT") == INTERRUPTED_EXIT_CODE == 130
    assert exit_code_for("SIGTERM") == exit_code_for("SIGUSR1") == REQUEUE_EXIT_CODE == 143


def test_the_warning_time_grows_with_the_checkpoint_and_is_whole_minutes():
    assert warning_seconds(0) == 120
    assert warning_seconds(100 * 2**30) % 60 == 0 and warning_seconds(100 * 2**30) > 500


def write_rank0_log(tmp_path, *records):
    path = rank_log_path(tmp_path, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize(("end", "delay", "expected"), [
    ({"event": "end", "interrupted": True}, 1, True),
    ({"event": "end", "interrupted": False}, 1, False),
    ({"event": "end", "interrupted": True}, -100, False),  # an earlier attempt's stop
    ({"event": "step", "step": 3}, 1, False),
])
def test_a_job_stopped_from_another_node_is_told_apart_from_a_finished_one(tmp_path, end, delay, expected):
    since = time.time()
    write_rank0_log(tmp_path, {"time": since - 200, "event": "start"}, {"time": since + delay, **end})
    assert stopped_elsewhere(tmp_path, since) is expected


def test_no_rank_log_is_not_a_stop(tmp_path):
    assert not stopped_elsewhere(tmp_path, time.time())


def test_a_requeued_slurm_job_resumes_instead_of_overwriting(monkeypatch):
    config = build_config({"model_name_or_path": "m", "output_dir": "o", "overwrite_output_dir": True})
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert continued_when_requeued(config).overwrite_output_dir is True
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert continued_when_requeued(config).overwrite_output_dir is False
