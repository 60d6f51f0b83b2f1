"""The rank server's clients (launch/rank_server.py): a process it forks, and one node's ranks started on it
instead of torchrun, watched as torchrun watches them."""

from __future__ import annotations

import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping

from shardtune.launch.rank_server import SERVER_VARIABLE, Channel


class ServerRefused(Exception):
    """The server cannot run this request as asked (its reason); the caller launches the usual way."""


class ServedProcess:
    """A process the rank server forked for us: its pid, its signals, its exit code."""

    def __init__(self, address: str, module: str, argv: list[str], env: Mapping[str, str], cwd: str,
                 fds: tuple[int, int, int]) -> None:
        """`python -m MODULE ARGV` (`python FILE ARGV` when ``module`` ends in .py) in ``cwd`` with ``env`` and the
        standard streams ``fds``, forked by the server."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(address)
        except OSError as err:
            connection.close()
            raise ServerRefused(f"no rank server at {address} ({err.strerror or err})") from None
        self.channel = Channel(connection)
        what = {"path": module} if module.endswith(".py") else {"module": module}
        self.channel.send({**what, "argv": argv, "env": dict(env), "cwd": cwd}, list(fds))
        answer = self.channel.receive()
        if answer is None or "pid" not in answer:
            self.channel.close()
            raise ServerRefused((answer or {}).get("refused", "the rank server closed the connection"))
        self.pid: int = answer["pid"]
        self.returncode: int | None = None
        self.left_running: list[str] = []  # processes it started that still ran when it ended (then killed)

    def fileno(self) -> int:
        return self.channel.fileno()

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            self.channel.send({"signal": int(signum)})

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.channel], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (negative: killed by that signal); TimeoutError after ``timeout`` seconds."""
        if self.returncode is None:
            if timeout is not None and not select.select([self.channel], [], [], timeout)[0]:
                raise TimeoutError
            self._read_exit()
        assert self.returncode is not None
        return self.returncode

    def _read_exit(self) -> None:
        message = self.channel.receive()
        # The server died under it: the process went with it (it dies with its handler).
        self.returncode = int(message["exit"]) if message and "exit" in message else -signal.SIGKILL
        self.left_running = list((message or {}).get("left_running", []))
        self.channel.close()

    def kill(self) -> None:
        """SIGKILL the process; its handler then kills whatever it started (its session)."""
        self.send_signal(signal.SIGKILL)


# How a served launch reports processes a rank started and left running (its handler killed them).
LEFT_RUNNING = "[shardtune] a rank of the rank server left processes running (killed):"


def server_address(env: Mapping[str, str]) -> str | None:
    return env.get(SERVER_VARIABLE) or None


TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default --signals-to-handle


def rank_environments(env: Mapping[str, str], nproc: int, master_addr: str, master_port: int,
                      run_id: str) -> list[dict[str, str]]:
    """Each rank's environment: ``env`` with its place in a one-node job, as torchrun sets it."""
    shared = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
              "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": master_addr,
              "MASTER_PORT": str(master_port), "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
              # No agent hosts a store here: rank 0 hosts the rendezvous store (env://).
              "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
              "TORCHELASTIC_SIGNALS_TO_HANDLE": env.get("TORCHELASTIC_SIGNALS_TO_HANDLE", TORCHRUN_SIGNALS),
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    return [{**env, **shared, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(nproc)]


# torchrun gives the ranks that are still running this long to stop after SIGTERM, once one rank failed.
STOP_AFTER_FAILURE_SECONDS = 30


def run_served_ranks(address: str, envs: list[dict[str, str]], program: list[str], cwd: str,
                     fds: tuple[int, int, int], group: RankGroup) -> list[int]:
    """Start ``program`` (`-m MODULE ARGS...` or `FILE ARGS...`) once per environment on the server, in ``cwd`` with
    the standard streams ``fds``, and wait for all of them; each one's exit code. As torchrun does, the first failure
    stops the others (SIGTERM, then SIGKILL). ServerRefused, with none of them left running, when the server cannot
    start them as asked."""
    target, args = (program[1], program[2:]) if program[0] == "-m" else (program[0], program[1:])
    try:
        for env in envs:
            group.ranks.append(ServedProcess(address, target, args, env, cwd, fds))
    except ServerRefused:
        group.kill_all()
        for rank in group.ranks:
            rank.wait()
        raise
    return wait_for_ranks(group.ranks)


def wait_for_ranks(ranks: list[ServedProcess]) -> list[int]:
    stop_at: float | None = None  # set at the first failure: the others' time to stop
    killed = False
    while any(rank.returncode is None for rank in ranks):
        running = [rank for rank in ranks if rank.returncode is None]
        timeout = None if stop_at is None or killed else max(0.0, stop_at - time.time())
        ready, _, _ = select.select(running, [], [], timeout)
        for rank in ready:
            rank.poll()
        if stop_at is None and any(rank.returncode not in (None, 0) for rank in ranks):
            for rank in running:
                rank.send_signal(signal.SIGTERM)
            stop_at = time.time() + STOP_AFTER_FAILURE_SECONDS
        elif stop_at is not None and not killed and time.time() >= stop_at:
            for rank in running:
                rank.kill()
            killed = True  # their handlers report each end
    return [int(rank.returncode) for rank in ranks]  # type: ignore[arg-type]


class RankGroup:
    """The ranks of a served launch, for the stop handlers (launch/supervise.py)."""

    def __init__(self) -> None:
        self.ranks: list[ServedProcess] = []

    def signal_all(self, signum: int) -> None:
        for rank in self.ranks:
            rank.send_signal(signum)

    def kill_all(self) -> None:
        for rank in self.ranks:
            rank.kill()


def stop_on_signals(group: RankGroup, stop_grace: float) -> list[int]:
    """Install the stop handlers of a served launch: the first request SIGTERMs the ranks (they save and exit),
    a second one, or ``stop_grace`` seconds without an end, kills them. The signals received, in order."""
    received: list[int] = []

    def stop(signum, frame) -> None:
        received.append(signum)
        if len(received) > 1:
            group.kill_all()
            return
        print(STOP_NOTICE, file=sys.stderr, flush=True)
        group.signal_all(signal.SIGTERM)
        timer = threading.Timer(stop_grace, group.kill_all)
        timer.daemon = True
        timer.start()

    from shardtune.launch.preemption import STOP_NOTICE, STOP_SIGNALS

    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, stop)
    return received
