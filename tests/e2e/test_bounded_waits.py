"""Every wait of a launch is bounded and named: a MASTER_ADDR that does not resolve or is not this machine on a
one-node run, a node 0 that never comes (a closed port), ranks that do not stop after SIGTERM, and a launcher
killed outright. Each ends in one line within its bound, and no process of the run is left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.launch.preemption import REQUEUE_EXIT_CODE
from shardtune.launch.supervise import descendants, kill_after
from tests.conftest import REPO, cli_env, overrides_merged, run_cli
from tests.distributed.test_nodes_netns import ADDRESSES, SCRIPT, pair  # noqa: F401 - the namespaces fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def processes_of(out: Path) -> list[int]:
    """Processes whose command line names ``out`` (the run's plan path is in every rank's)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(out) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def none_left(out: Path, within: float = 20) -> bool:
    deadline = time.monotonic() + within
    while processes_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not processes_of(out)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "examples/tiny/sft_lora.yaml", f"model_name_or_path={model}", f"output_dir={out}",
            "plot_loss=false", *extra]


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("shardtune: error:")]


def test_a_master_addr_that_does_not_resolve_is_one_line_at_once(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    result = run_cli(*train_args(tiny_model_dir, out, "max_steps=2"), timeout=120,
                     MASTER_ADDR="node-zero.invalid", NPROC_PER_NODE="2")
    assert result.returncode == 2 and time.monotonic() - started < 60, result.stderr
    [line] = errors(result.stderr)
    assert "MASTER_ADDR=node-zero.invalid cannot be resolved" in line and "Traceback" not in result.stderr
    assert none_left(out)


@pytest.mark.distributed
def test_a_foreign_master_addr_on_one_node_is_one_line_at_once(pair, tiny_model_dir, tmp_path):  # noqa: F811
    """Node a's one-node run names node b's address (another host): refused before torchrun starts."""
    out = tmp_path / "run"
    suffix, side, _ = pair[0]
    started = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT), "run", suffix, side, sys.executable, "-m", "shardtune",
                             *train_args(tiny_model_dir, out, "max_steps=2")], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env=cli_env(MASTER_ADDR=ADDRESSES[1], NPROC_PER_NODE="2"))
    assert result.returncode == 2 and time.monotonic() - started < 60, result.stderr
    [line] = errors(result.stderr)
    assert f"MASTER_ADDR={ADDRESSES[1]} is not an address of node 0" in line
    assert none_left(out)


@pytest.mark.distributed
def test_a_node_waiting_on_a_closed_port_ends_in_one_line_within_its_bound(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    result = run_cli(*train_args(tiny_model_dir, out, "max_steps=2"), timeout=120, NNODES="2", NODE_RANK="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(closed_port()), NPROC_PER_NODE="1", RDZV_TIMEOUT="5")
    waited = time.monotonic() - started
    # the bound, and the CLI's start before it (TCPStore's own connect waited 46 s here for a 5 s bound)
    assert result.returncode == 2 and waited < 5 + 20, (waited, result.stderr)
    [line] = errors(result.stderr)
    assert "node 0 never arrived within 5 s" in line
    assert "TCPStore" not in result.stderr and "Exception raised" not in result.stderr, result.stderr
    assert none_left(out)


class Launch:
    """A 2-process `shardtune train` in its own session, its output in files."""

    def __init__(self, model: Path, out: Path, logs: Path) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.stderr_path = logs / "stderr.txt"
        argv = [sys.executable, "-m", "shardtune", *overrides_merged(train_args(
            model, out, "max_steps=100000", "save_steps=5", "logging_steps=5", "per_device_train_batch_size=2",
            "gradient_accumulation_steps=1"))]
        with (logs / "stdout.txt").open("w") as stdout, self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(argv, cwd=REPO, env=cli_env(NPROC_PER_NODE="2"), stdout=stdout,
                                            stderr=stderr, start_new_session=True)

    def wait_for(self, folder: Path, pattern: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(folder.glob(pattern)):
            assert self.process.poll() is None, self.stderr_path.read_text()[-3000:]
            assert time.monotonic() < deadline, self.stderr_path.read_text()[-3000:]
            time.sleep(0.1)

    def ranks(self) -> list[int]:
        """The rank processes (torchrun's own command line names shardtune.train too)."""
        lines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                 for pid in descendants(self.process.pid)}
        return [pid for pid, line in lines.items() if "shardtune.train" in line and "torchrun_agent" not in line]


@pytest.mark.distributed
def test_a_launcher_killed_outright_leaves_no_process(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    launch = Launch(tiny_model_dir, out, tmp_path / "logs")
    try:
        launch.wait_for(out, "checkpoint-*/COMPLETE")
        launch.process.kill()  # SIGKILL: nothing of the launcher runs after it
        launch.process.wait(timeout=30)
        assert none_left(out, within=60), processes_of(out)
    finally:
        for pid in processes_of(out):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.distributed
def test_a_second_stop_request_kills_ranks_that_cannot_stop(tiny_model_dir, tmp_path):
    """One rank frozen: the other cannot finish its step (it waits in a collective). The first SIGTERM asks for a
    stop, the second kills the job at once, in one line, and the saved checkpoints stay."""
    out = tmp_path / "run"
    launch = Launch(tiny_model_dir, out, tmp_path / "logs")
    try:
        launch.wait_for(out, "checkpoint-*/COMPLETE")
        ranks = launch.ranks()
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGSTOP)
        time.sleep(1)
        saved = sorted(p.name for p in out.glob("checkpoint-*") if (p / "COMPLETE").is_file())
        launch.process.send_signal(signal.SIGTERM)
        time.sleep(2)
        started = time.monotonic()
        launch.process.send_signal(signal.SIGTERM)
        code = launch.process.wait(timeout=60)
        assert time.monotonic() - started < 30
    finally:
        for pid in processes_of(out):
            os.kill(pid, signal.SIGKILL)
    stderr = launch.stderr_path.read_text()
    assert code == REQUEUE_EXIT_CODE, stderr[-3000:]  # stopped by SIGTERM, as a scheduler stops a job
    assert any("the ranks did not stop (a second stop request" in line for line in errors(stderr)), stderr[-3000:]
    assert none_left(out)
    assert all((out / name / "COMPLETE").is_file() for name in saved)


def test_the_stop_bound_kills_a_job_that_does_not_stop(tmp_path):
    """kill_after's bound: a job (here a process tree that ignores SIGTERM) still running is killed, all of it, and
    nothing else this process started (a test session's rank server was killed as an "adopted orphan" once)."""
    unrelated = subprocess.Popen(["sleep", "60"])
    tree = subprocess.Popen([sys.executable, "-c", "import signal, subprocess, sys, time; "
                             "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                             "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); "
                             "time.sleep(600)']); time.sleep(600)"], start_new_session=True)
    deadline = time.monotonic() + 30
    while not descendants(tree.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = descendants(tree.pid)[0]
    started = time.monotonic()
    kill_after(tree, 1.0)
    assert tree.wait(timeout=10) == -signal.SIGKILL and time.monotonic() - started < 10
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        with __import__("contextlib").suppress(ChildProcessError):
            os.waitpid(child, os.WNOHANG)
        time.sleep(0.05)
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert unrelated.poll() is None, "kill_after killed a process that is not the job's"
    unrelated.kill()
    unrelated.wait()
