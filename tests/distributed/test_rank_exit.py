"""A rank ends through launch.worker.leave_rank: gloo's threads cannot abort it at exit, and nothing is lost.

The abort (scripts/repro_gloo_exit_abort.py, leave_rank's docstring): a gloo worker thread that still runs when
interpreter shutdown begins and then releases a tensor made in Python is ended by CPython inside a noexcept
destructor, and std::terminate aborts the finished rank. ``--end late_release`` makes that release certain to
come during shutdown; a normal exit then aborts in most runs, leave_rank in none.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


REPRO = REPO / "scripts" / "repro_gloo_exit_abort.py"


def load_repro():
    spec = importlib.util.spec_from_file_location("repro_gloo_exit_abort", REPRO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_pair(*args: str) -> tuple[list[int], list[str]]:
    repro = load_repro()
    return repro.run_pair(repro.parse_args(["--timeout", "120", *args]))


def test_late_release_aborts_a_normal_exit():
    """The scenario the next test relies on: without leave_rank a rank dies by SIGABRT (most runs; up to 4)."""
    for _ in range(4):
        codes, errors = run_pair("--end", "late_release")
        if -signal.SIGABRT in codes:
            assert any("terminate called" in e for e in errors), errors
            return
    pytest.fail(f"no SIGABRT in 4 runs; last exit codes {codes}")


def test_leave_rank_never_aborts():
    for _ in range(2):  # a normal exit aborts about 5 runs in 6 here (scripts/repro_gloo_exit_abort.py)
        codes, errors = run_pair("--end", "late_release", "--exit", "leave_rank")
        assert codes == [0, 0], errors


LEAVE = r"""
import atexit, logging, logging.handlers, sys
from shardtune.launch.worker import leave_rank

# Buffered until logging's own exit handler closes it: the record reaches the file only if exit handlers run.
buffered = logging.handlers.MemoryHandler(1000, target=logging.FileHandler(sys.argv[1]))
logging.getLogger("t").addHandler(buffered)
logging.getLogger("t").warning("logged before leaving")
atexit.register(lambda: print("exit handler ran", end=""))
sys.stdout.write("buffered, ")
sys.stderr.write("to stderr")
leave_rank(int(sys.argv[2]))
print("never printed")
"""


def test_leave_rank_keeps_exit_code_output_and_logs(tmp_path):
    """Exit codes 0 (the runs above) and 2 (tests/distributed/test_rank_failures.py) are covered elsewhere."""
    log = tmp_path / "run.log"
    result = subprocess.run([sys.executable, "-c", LEAVE, str(log), "130"], env=cli_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 130
    assert result.stdout == "buffered, exit handler ran" and result.stderr == "to stderr"
    assert "logged before leaving" in log.read_text()
