"""The machine's cores, shared by the test session's workers (pytest -n): a test runs only while it holds the cores
it needs, so that cells of two processes and cells of one are packed onto the cores there are, never more.

Each core is a lock file (``flock``); a test takes the cores it needs before its setup and gives them back after its
teardown. Takers queue behind one turnstile lock, so a test that needs every core is not starved by a stream of
one-core tests. The kernel drops a dead worker's locks: a crashed worker never leaves a core taken.

What a test needs: ``@pytest.mark.cores(N)``; otherwise the tier's default (``DEFAULT_BY_TIER``: the unit tier runs
in the test process, the others start ranks), corrected by the measured table ``tests/cores_measured.txt`` (tests
whose measured use differs from their tier's default; scripts/measure_test_cores.sh writes it).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ENV = "SHARDTUNE_TEST_CORES"  # the folder of the lock files, set by the controlling pytest process for its workers
# A file each worker appends one line per test to (worker, test, cores, asked, held, done: seconds since the epoch),
# for scripts/test_timeline.py: where make test's wall time goes (waiting for cores, running, idle workers).
TIMELINE_ENV = "SHARDTUNE_TEST_TIMELINE"
MEASURED = Path(__file__).with_name("cores_measured.txt")
DEFAULT_BY_TIER = {"unit": 1}  # every other tier: all cores
POLL_SECONDS = 0.05


def machine_cores() -> int:
    return len(os.sched_getaffinity(0))


def make_pool() -> str:
    """A new folder of one lock file per core (and the turnstile), for this session's workers."""
    folder = tempfile.mkdtemp(prefix="shardtune-cores-")
    for index in range(machine_cores()):
        Path(folder, f"core{index}").touch()
    Path(folder, "turnstile").touch()
    return folder


@functools.cache
def measured_needs(path: Path = MEASURED) -> dict[str, int]:
    """``{test id: cores}`` from the measured table (lines ``CORES TEST_ID``; ``#`` comments)."""
    needs: dict[str, int] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                count, test_id = line.split(maxsplit=1)
                needs[test_id] = int(count)
    return needs


def need_of(nodeid: str, marker_count: int | None, measured: dict[str, int], available: int) -> int:
    """The cores a test takes: its marker, else the measured table, else its tier's default; at most ``available``."""
    tier = nodeid.split("/")[1] if nodeid.startswith("tests/") else ""
    wanted = marker_count or measured.get(nodeid) or DEFAULT_BY_TIER.get(tier, available)
    return max(1, min(wanted, available))


@contextmanager
def holding(folder: str, count: int):
    """Hold ``count`` of the pool's cores for the duration of the block (waiting, in turn, until they are free)."""
    cores = sorted(Path(folder).glob("core*"))
    held: list = []
    try:
        with open(Path(folder, "turnstile")) as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)  # one taker at a time, in the order they came
            while len(held) < count:
                for core in cores:
                    if len(held) == count:
                        break
                    handle = open(core)  # noqa: SIM115 - held until the test ends
                    try:
                        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        handle.close()
                        continue
                    held.append(handle)
                if len(held) < count:
                    time.sleep(POLL_SECONDS)
        yield
    finally:
        for handle in held:
            handle.close()  # closing drops the lock


def record_timeline(test_id: str, need: int, asked: float, held: float, done: float) -> None:
    """One line of the timeline file, where ``SHARDTUNE_TEST_TIMELINE`` names one."""
    path = os.environ.get(TIMELINE_ENV)
    if path:
        line = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": test_id, "cores": need,
                "asked": asked, "held": held, "done": done}
        with open(path, "a") as handle:  # one short write per line: the workers' lines do not interleave
            handle.write(json.dumps(line) + "\n")
