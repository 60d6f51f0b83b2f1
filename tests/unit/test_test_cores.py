"""The cores the test session's workers share (tests/cores.py): never more taken than there are, a test that needs
every core is not starved, and a dead holder's cores are free again."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from tests import cores


@pytest.fixture
def two_core_pool(monkeypatch, tmp_path) -> str:
    monkeypatch.setattr(cores, "machine_cores", lambda: 2)
    return cores.make_pool()


def _hold(pool: str, count: int, log: str, seconds: float) -> None:
    with cores.holding(pool, count):
        with open(log, "a") as out:
            out.write(f"start {os.getpid()} {count} {time.monotonic()}\n")
        time.sleep(seconds)
        with open(log, "a") as out:
            out.write(f"end {os.getpid()} {count} {time.monotonic()}\n")


def cores_in_use_at_most(log: Path) -> int:
    busy = peak = 0
    for line in sorted(log.read_text().splitlines(), key=lambda x: float(x.split()[3])):
        kind, _, count, _ = line.split()
        busy += int(count) if kind == "start" else -int(count)
        peak = max(peak, busy)
    return peak


def test_takers_never_hold_more_cores_than_there_are_and_all_get_their_turn(two_core_pool, tmp_path):
    log = tmp_path / "log"
    context = multiprocessing.get_context("fork")
    takers = [context.Process(target=_hold, args=(two_core_pool, count, str(log), 0.3)) for count in (1, 2, 1, 1, 2)]
    for taker in takers:
        taker.start()
    for taker in takers:
        taker.join(30)
    assert [taker.exitcode for taker in takers] == [0] * 5
    assert cores_in_use_at_most(log) == 2
    assert len(log.read_text().splitlines()) == 10


def test_a_test_that_needs_every_core_is_not_starved_by_one_core_tests(two_core_pool, tmp_path):
    log = tmp_path / "log"
    context = multiprocessing.get_context("fork")
    first = context.Process(target=_hold, args=(two_core_pool, 1, str(log), 1.0))
    first.start()
    time.sleep(0.3)
    wide = context.Process(target=_hold, args=(two_core_pool, 2, str(log), 0.1))
    wide.start()
    time.sleep(0.3)
    late = context.Process(target=_hold, args=(two_core_pool, 1, str(log), 0.1))  # came after the wide one
    late.start()
    for taker in (first, wide, late):
        taker.join(30)
    starts = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("start")]
    assert starts == [str(first.pid), str(wide.pid), str(late.pid)]


def test_the_cores_of_a_killed_holder_are_free_again(two_core_pool, tmp_path):
    context = multiprocessing.get_context("fork")
    holder = context.Process(target=_hold, args=(two_core_pool, 2, str(tmp_path / "log"), 60))
    holder.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "log").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    started = time.monotonic()
    with cores.holding(two_core_pool, 2):
        assert time.monotonic() - started < 5


def test_what_a_test_needs_marker_then_measured_then_tier():
    measured = {"tests/e2e/test_x.py::test_one_process": 1}
    assert cores.need_of("tests/unit/test_x.py::test_a", None, measured, 2) == 1
    assert cores.need_of("tests/distributed/test_x.py::test_a", None, measured, 2) == 2
    assert cores.need_of("tests/e2e/test_x.py::test_one_process", None, measured, 2) == 1
    assert cores.need_of("tests/unit/test_x.py::test_a", 4, measured, 2) == 2  # never more than there are
    assert cores.need_of("tests/e2e/test_x.py::test_one_process", 2, measured, 2) == 2


def test_the_timeline_says_how_full_the_cores_were_and_who_waited(tmp_path, monkeypatch):
    """Each worker appends a line per test (SHARDTUNE_TEST_TIMELINE); scripts/test_timeline.py sums them."""
    import importlib.util
    import json

    from tests import cores

    timeline = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(cores.TIMELINE_ENV, str(timeline))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    cores.record_timeline("tests/distributed/test_a.py::test_x", 2, 0.0, 0.0, 10.0)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    cores.record_timeline("tests/unit/test_b.py::test_y", 1, 0.0, 10.0, 15.0)  # waited for the cores 10 s
    rows = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert [row["worker"] for row in rows] == ["gw0", "gw1"]
    spec = importlib.util.spec_from_file_location("test_timeline", cores.MEASURED.parents[1] / "scripts" /
                                                  "test_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summary = module.summarize(rows, cores=2, top=5)
    assert summary.splitlines()[0] == "2 tests over 15 s; cores held 25 core-s of 2 x 15 = 83%"
    assert "gw1: 1 tests, running       5 s, waiting for cores     10 s" in summary
    assert "     20  distributed" in summary and "      5  unit" in summary
