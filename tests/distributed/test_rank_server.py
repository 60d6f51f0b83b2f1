"""The rank server (src/shardtune/launch/rank_server.py) runs a cell as a new process would: the environment torchrun
gives a rank, no state left by the cells before, the same training result as a real launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.host import process_alive
from shardtune.launch.served import ServedProcess, rank_environments
from tests import rank_server
from tests.conftest import REPO, cli_env, run_cli
from tests.distributed.helpers import COMMON, losses
from tests.rank_server import run_python, server_address

pytestmark = pytest.mark.distributed
CELLS = "tests.distributed.rank_server_cells"


def served_cell(mode: str, out: Path, **extra: str) -> None:
    address = server_address()
    if address is None:
        pytest.skip("the rank server did not start")
    with open(os.devnull) as stdin, open(out.with_suffix(".log"), "w") as log:
        process = ServedProcess(address, CELLS, [mode, str(out)], cli_env(**extra), str(REPO),
                                (stdin.fileno(), log.fileno(), log.fileno()))
    assert process.wait(120) == 0, out.with_suffix(".log").read_text()


def new_process_cell(mode: str, out: Path, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", CELLS, mode, str(out)], cwd=REPO, env=env, check=True, timeout=120)


def test_a_cell_that_changes_global_state_leaves_the_next_cell_a_new_process(tmp_path):
    """A process group left open, an environment variable, DeepSpeed's Init globals and patched constructors, the
    RNGs, a module attribute, the default dtype, the thread count, a thread: none reaches the next cell."""
    served_cell("disturb", tmp_path / "disturbed.json")
    served_cell("observe", tmp_path / "served.json")
    served_cell("observe", tmp_path / "served_again.json")
    new_process_cell("observe", tmp_path / "new.json", cli_env())
    served, again, new = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("served", "served_again", "new"))
    # torch's and Python's generators start from the system's entropy in every new process: in every fork too.
    for generator in ("python_rng", "torch_rng"):
        assert len({str(cell.pop(generator)) for cell in (served, again, new)}) == 3
    assert served == new == again
    assert served["variable"] is None and not served["process_group"] and served["threads"] == 1


def test_a_served_rank_has_the_environment_torchrun_gives_it(tmp_path):
    """Derived from torchrun itself: what it adds to a rank's environment, the rank server's ranks get too."""
    env = cli_env()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", CELLS,
                    "env", str(tmp_path / "torchrun.json")], cwd=REPO, env=env, check=True, timeout=120,
                   capture_output=True)
    torchrun_env = json.loads((tmp_path / "torchrun.json.rank1").read_text())
    added_by_torchrun = {n for n in torchrun_env if n not in env or torchrun_env[n] != env[n]}
    served = rank_environments(env, 2, "127.0.0.1", 29500, "run")[1]
    added_by_us = {n for n in served if n not in env}
    # torchrun's own bookkeeping (its error file, its rendezvous store for the agent) has no server counterpart.
    internal = {n for n in added_by_torchrun if n.startswith(("TORCHELASTIC_ERROR_FILE", "TORCH_ELASTIC"))}
    assert added_by_torchrun - internal - {"OMP_NUM_THREADS"} <= added_by_us | {"LOCAL_RANK"}
    same = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_RANK",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_SIGNALS_TO_HANDLE")
    assert {n: served[n] for n in same} == {n: torchrun_env[n] for n in same}
    # torchrun's agent hosts the rendezvous store its ranks join; with no agent, rank 0 hosts it (env:// as usual).
    assert (torchrun_env["TORCHELASTIC_USE_AGENT_STORE"], served["TORCHELASTIC_USE_AGENT_STORE"]) == ("True", "False")
    assert (served["RANK"], served["LOCAL_RANK"], served["ROLE_RANK"]) == \
        (torchrun_env["RANK"], torchrun_env["LOCAL_RANK"], torchrun_env["ROLE_RANK"])


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_a_served_run_after_a_disturbing_cell_equals_a_real_launch(engine, tiny_model_dir, tmp_path, monkeypatch):
    """The same 2-rank run, forked by the server after a cell that left global state behind, and launched for real
    (torchrun, new processes): the same losses, bit for bit."""
    served_cell("disturb", tmp_path / "disturbed.json")
    keys = ("fsdp=full_shard auto_wrap",) if engine == "fsdp2" else ("deepspeed=z3",)
    outs = {}
    for launch in ("served", "real"):
        outs[launch] = tmp_path / launch
        monkeypatch.setenv("SHARDTUNE_TEST_LAUNCH", launch)
        result = run_cli("train", *COMMON, f"model_name_or_path={tiny_model_dir}", f"output_dir={outs[launch]}",
                         *keys, FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
        assert result.returncode == 0, result.stderr[-3000:]
        served_line = "ranks on the rank server" in result.stdout
        assert served_line == (launch == "served"), result.stdout[-2000:]
    assert losses(outs["served"]) == losses(outs["real"])


def test_what_a_served_cell_leaves_behind_is_found_and_its_processes_are_killed(tmp_path):
    """A process still running and a file in the temporary folder after a cell: the handler kills the process, and
    the cell is listed (conftest's _launch_kind fails the test that ran it; here the test takes the entry back)."""
    if server_address() is None:
        pytest.skip("the rank server did not start")
    before = len(rank_server.LEAKS)
    done = run_python([sys.executable, str(REPO / "tests" / "distributed" / "rank_server_cells.py"), "leak",
                       str(tmp_path / "leak.json")], cli_env(), REPO, 120)
    assert done.returncode == 0, done.stderr
    left = json.loads((tmp_path / "leak.json").read_text())
    found = rank_server.LEAKS[before:]
    del rank_server.LEAKS[before:]
    assert len(found) == 1 and "sleep 60" in found[0] and Path(left["file"]).name in found[0]
    os.unlink(left["file"])
    assert gone_within(left["pid"], 10), "the process the cell left is still running"


STARTER = """
import subprocess, sys, threading, time
started = {}
def start():
    started["server"] = subprocess.Popen([sys.executable, "-m", "shardtune.launch.rank_server", sys.argv[1]],
                                         stdout=subprocess.PIPE, text=True)
thread = threading.Thread(target=start)
thread.start()
thread.join()  # the thread that started the server has ended
print(started["server"].stdout.readline().strip(), started["server"].pid, flush=True)
time.sleep(600)
"""


def test_a_server_started_from_a_thread_serves_after_it_ends_and_stops_with_its_parent(tmp_path):
    """A client may start the server from a thread (PR_SET_PDEATHSIG would stop it when that thread ends); the
    server watches its parent process instead, and ends when that dies."""
    address = str(tmp_path / "server.sock")
    starter = subprocess.Popen([sys.executable, "-c", STARTER, address], cwd=REPO, env=cli_env(),
                               stdout=subprocess.PIPE, text=True)
    try:
        words = starter.stdout.readline().split()  # "ready PID PID"
        assert words and words[0] == "ready", words
        server_pid = int(words[-1])
        with open(os.devnull) as stdin, open(tmp_path / "cell.log", "w") as log:
            process = ServedProcess(address, CELLS, ["observe", str(tmp_path / "cell.json")], cli_env(), str(REPO),
                                    (stdin.fileno(), log.fileno(), log.fileno()))
        assert process.wait(120) == 0, (tmp_path / "cell.log").read_text()
    finally:
        starter.kill()
        starter.wait()
    assert gone_within(server_pid, 10), "the server outlived its parent"


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` ended (or is a zombie: ended, not yet reaped) within ``seconds`` (a SIGKILL takes
    effect asynchronously)."""
    deadline = time.monotonic() + seconds
    while process_alive(pid, None) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not process_alive(pid, None)
