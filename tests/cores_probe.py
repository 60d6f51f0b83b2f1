"""pytest plugin that measures the cores each test keeps busy, for tests/cores.py's table.

    scripts/measure_test_cores.sh        (runs the make-test selection alone, one test at a time: about 20 minutes)

The machine's busy time (/proc/stat, every process: the test's own and those it starts) over the test's wall time,
setup and teardown included. Run it on a machine doing nothing else. Writes tests/cores_measured.txt: the tests
whose measured need differs from their tier's default. A test shorter than ``MIN_SECONDS`` counts as one of one
core: it cannot crowd the machine for long, and a test that waits for every core makes the other workers wait.
"""

from __future__ import annotations

import os
import time

import pytest

from tests import cores

MIN_SECONDS = 1.0
TWO_CORES_FROM = 1.1  # average busy cores from which a test counts as one that needs two
_MEASURED: list[tuple[str, float, float]] = []  # (test id, wall seconds, average busy cores)


def busy_seconds() -> float:
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, busy = time.monotonic(), busy_seconds()
    yield
    wall = time.monotonic() - started
    _MEASURED.append((item.nodeid, wall, (busy_seconds() - busy) / max(wall, 1e-6)))


def measured_table(measured: list[tuple[str, float, float]], available: int) -> list[str]:
    lines = []
    for test_id, wall, busy in measured:
        need = min(available, 2 if busy >= TWO_CORES_FROM and wall >= MIN_SECONDS else 1)
        if need != cores.need_of(test_id, None, {}, available):
            lines.append(f"{need} {test_id}")
    return lines


def pytest_sessionfinish(session):
    if not _MEASURED or hasattr(session.config, "workerinput"):
        return
    header = ("# Tests whose measured core use differs from their tier's default (tests/cores.py).\n"
              "# Written by scripts/measure_test_cores.sh; CORES TEST_ID.\n")
    body = measured_table(_MEASURED, cores.machine_cores())
    cores.MEASURED.write_text(header + "".join(line + "\n" for line in sorted(body)))
