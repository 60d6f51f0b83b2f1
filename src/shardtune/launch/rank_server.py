"""A process that imported the stack once and forks the processes of runs from it: fast feedback.

A rank started by torchrun imports torch, transformers, peft, datasets and DeepSpeed before it does anything (about
5 s of a tiny run's 9 on a 2-core CPU), and torchrun's agent imports torch too. The rank server imports them once,
then, for each request, forks a process that runs `python -m MODULE ARGS` or `python FILE ARGS` (``runpy``, as the
interpreter does), where it was asked, with the environment it was given:

- a rank: `python -m shardtune.train PLAN` as torchrun starts it (the worker entry, launch/worker.py), its place in
  the job in its environment (RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun sets them);
- the CLI: `python -m shardtune ARGS` (the test suite's runs of it; a `train` among them asks the same server for
  its ranks).

    python -m shardtune.launch.rank_server /tmp/ranks.sock &       # prints "ready" once the imports are done
    SHARDTUNE_RANK_SERVER=/tmp/ranks.sock shardtune train cfg.yaml  # one node's ranks come from the server

What is the same as a real launch: the module, its arguments, its environment, its working directory, its
standard streams (passed over the socket), its exit code, its signals. What is not: the modules are those the
server imported, so a request whose environment differs from the server's in a variable read at import time
(``IMPORT_TIME_VARIABLES``) is refused and the caller launches for real; the process is a fork, so the server itself
never runs a tensor operation (libgomp's pool does not survive a fork) or starts a Python thread, and checks that.

Each request has its own connection, served by a forked handler that forks the process and reports on it:
``{"pid": P}`` once it runs, ``{"exit": code}`` when it ends (a negative code: killed by that signal). The client
may send ``{"signal": N}`` at any time; a client that goes away (its connection closes) takes the process and
everything it started with it (SIGKILL to its session).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from shardtune.launch.torchrun_agent import die_with_parent

# Read when a library is imported or a process starts, so a forked process cannot take a new value of them:
# a request that changes one is refused (the caller launches the usual way). OMP_NUM_THREADS and glibc's mmap
# threshold are read at start too, but the forked process applies them itself (``apply_process_settings``).
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "HF_", "HUGGINGFACE", "TRANSFORMERS_", "TORCH", "PYTORCH_", "DS_",
                        "DEEPSPEED", "TOKENIZERS_", "MKL_", "KMP_", "GOMP_", "OMP_", "MALLOC_", "GLIBC_", "CUDA_",
                        "BNB_", "ACCELERATE_", "DATASETS_", "TRITON_", "XDG_", "HOME")
APPLIED_HERE = ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")
# A launcher's settings of each rank (read when the group starts), where compiled ops are cached (read when one is
# built), whether the tokenizers may use threads (read at their first parallel use).
READ_AT_RUN_TIME = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCH_EXTENSIONS_DIR", "TOKENIZERS_PARALLELISM")
STARTED_WITH: dict[str, str] = {}  # the server's environment before its imports: what requests are compared with
SET_BY_IMPORTS: dict[str, str] = {}  # what the imports set (torch sets a few): a new process's imports would too
STARTED_ON_PATH: list[str] = []  # the server's sys.path when it started (a request's PYTHONPATH may name these)
SERVER_VARIABLE = "SHARDTUNE_RANK_SERVER"  # the socket of a server to take a node's ranks from


def import_time_differences(served: Mapping[str, str], wanted: Mapping[str, str], on_path: Sequence[str] = (),
                            cwd: str = "/") -> list[str]:
    """The variables ``wanted`` sets differently from ``served`` that a forked process could not honour
    (``on_path``, ``cwd``: the server's import path and the request's folder, for PYTHONPATH)."""
    names = set(served) | set(wanted)
    return sorted(n for n in names if n.startswith(IMPORT_TIME_PREFIXES) and not n.startswith(READ_AT_RUN_TIME)
                  and n not in APPLIED_HERE and served.get(n) != wanted.get(n)
                  and not (n == "PYTHONPATH" and python_path_honoured(served.get(n), wanted.get(n), on_path, cwd)))


def python_path_entries(value: str | None, cwd: str) -> list[str]:
    """PYTHONPATH's folders as the interpreter puts them on sys.path (an empty entry is the working folder)."""
    return [os.path.realpath(os.path.join(cwd, entry)) for entry in value.split(os.pathsep)] if value else []


def python_path_honoured(served: str | None, wanted: str | None, on_path: Sequence[str], cwd: str) -> bool:
    """Whether a fork can take ``wanted`` PYTHONPATH: it keeps the server's entries and adds only folders already on
    the server's path (what the server imported was found there too; run_entry moves them to the front, where a new
    process has them). A folder new to the server could hold other copies of what it imported: refused."""
    wanted_entries = python_path_entries(wanted, cwd)
    known = {os.path.realpath(entry) for entry in on_path}
    return set(python_path_entries(served, cwd)) <= set(wanted_entries) and set(wanted_entries) <= known


def preload() -> None:
    """Import what a run imports (the engines, the models' code, the data stack), without running any of it."""
    import importlib
    import pkgutil

    import shardtune

    for name in ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
                 "transformers", "peft", "datasets", "accelerate", "deepspeed", "safetensors.torch",
                 "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                 "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe"):
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    for module in pkgutil.walk_packages(shardtune.__path__, "shardtune."):
        if module.name.endswith("__main__"):
            continue
        with contextlib.suppress(Exception):  # a module whose optional dependency is missing loads in the run
            importlib.import_module(module.name)


def serve(address: str) -> NoReturn:
    """Import, check that this process may fork, then fork a handler per connection until SIGTERM or the parent's
    death. The parent is watched in the loop, not with PR_SET_PDEATHSIG: that signal comes when the *thread* that
    started this process ends, and a client may start the server from a thread that ends before it does."""
    parent = os.getppid()
    import gc

    STARTED_WITH.update(os.environ)
    STARTED_ON_PATH.extend(sys.path)
    gc.disable()
    stdout = os.dup(1)
    os.dup2(2, 1)  # what the imports print goes to the log; this process's stdout says "ready" and nothing else
    preload()
    sys.stdout.flush()
    os.dup2(stdout, 1)
    os.close(stdout)
    SET_BY_IMPORTS.update({n: v for n, v in os.environ.items() if STARTED_WITH.get(n) != v})
    gc.freeze()  # the imported objects are never scanned again, in the server or in its forks
    gc.enable()
    import threading

    # Python threads could hold a lock a fork needs. Native ones are as in any process a DataLoader forks from: torch
    # starts one at import, pyarrow its allocator's (jemalloc_bg_thd, which handles forks itself).
    if threading.active_count() != 1:
        names = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
        sys.exit(f"rank server: the imports started Python threads {names}; a fork would lose them")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)
    listener.bind(address)
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    print(f"ready {os.getpid()}", flush=True)
    while os.getppid() == parent:  # an orphan is adopted by another process
        reap_handlers()
        ready, _, _ = select.select([listener], [], [], 1.0)
        if not ready:
            continue
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            handle(connection)
        connection.close()
    listener.close()
    with contextlib.suppress(OSError):
        os.unlink(address)
    os._exit(0)


def reap_handlers() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def handle(connection: socket.socket) -> NoReturn:
    """One request: fork its process, report its pid and exit code, pass signals on, and take it down if the
    client goes away."""
    channel = Channel(connection)
    try:
        request, fds = channel.receive_request()
    except (OSError, ValueError) as err:
        channel.send({"refused": f"bad request: {err}"})
        os._exit(0)
    problem = request_problem(request, fds)
    if problem:
        channel.send({"refused": problem})
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        connection.close()
        run_entry(request, fds)
    for fd in fds:
        os.close(fd)
    channel.send({"pid": pid})
    supervise(channel, pid)
    os._exit(0)


def request_problem(request: dict[str, Any], fds: list[int]) -> str | None:
    if len(fds) != 3:
        return "the request must carry the process's standard input, output and error"
    if not isinstance(request.get("module") or request.get("path"), str) or not isinstance(request.get("argv"), list):
        return "the request must name a module (or a script's path) and its arguments"
    # A variable the imports set is as good absent as set to what they set (a client forked here passes it on).
    differences = import_time_differences({**SET_BY_IMPORTS, **STARTED_WITH},
                                          {**SET_BY_IMPORTS, **request.get("env", {})}, STARTED_ON_PATH,
                                          str(request.get("cwd", "/")))
    if differences:
        return "the environment differs in variables read at import time: " + ", ".join(differences)
    return None


def supervise(channel: Channel, pid: int) -> None:
    """Wait for the process while passing the client's signals on; its exit code reaches the client."""
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([channel.fileno(), pidfd], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            left = session_members(pid)
            kill_process_group(pid)  # what it started and left behind
            channel.send({"exit": os.waitstatus_to_exitcode(status), "left_running": left})
            return
        message = channel.receive()
        if message is None:  # the client went away: so does its process
            kill_process_group(pid)
            os.waitpid(pid, 0)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, int(message.get("signal", 0)))


def session_members(session: int) -> list[str]:
    """The processes still in ``session`` (the served process's, which has ended): their command lines."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            # The fields after the name: state, ppid, pgrp, session. A zombie (Z) has ended: nothing runs.
            if int(fields[3]) == session and fields[0] != "Z":
                found.append(stat.with_name("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return found


def kill_process_group(pid: int) -> None:
    """SIGKILL what is left of the served process's session (it leads its own group: ``setsid``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_entry(request: dict[str, Any], fds: list[int]) -> NoReturn:
    """In the forked process: become the requested process, run its entry, leave with its exit code."""
    os.setsid()
    die_with_parent(signal.SIGKILL)
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    sys.stdin = open(0, closefd=False, encoding="utf-8")
    sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False, encoding="utf-8", errors="backslashreplace")
                              for fd in (1, 2))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update({**SET_BY_IMPORTS, **request["env"]})
    os.chdir(request["cwd"])
    script = request.get("path")
    # As the interpreter does: `python -m` puts the working directory first on the path, `python FILE` its folder.
    sys.path[0] = str(Path(script).resolve().parent) if script else request["cwd"]
    added = python_path_entries(request["env"].get("PYTHONPATH"), request["cwd"])  # each already on the path
    sys.path[1:] = added + [entry for entry in sys.path[1:] if os.path.realpath(entry) not in added]
    sys.argv = [script or "-m", *request["argv"]]  # runpy puts the module's file first, as `python -m` does
    apply_process_settings(request["env"])
    reset_random_state()
    code = 1
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        if end.code is not None and not isinstance(end.code, int):
            print(end.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit code 1
        import traceback

        traceback.print_exc()
    leave(code)


def apply_process_settings(env: Mapping[str, str]) -> None:
    """What a new process would have taken from its environment at start."""
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    threshold = env.get("MALLOC_MMAP_THRESHOLD_", "")
    if threshold.isdigit():
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).mallopt(-3, int(threshold))  # M_MMAP_THRESHOLD


def reset_random_state() -> None:
    """The random generators as a new process finds them: seeded afresh from the system (torch, Python and NumPy
    all seed from the system at start), where a fork would share the server's state and every cell draw the same."""
    import random

    random.seed()
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed()
    import torch

    torch.seed()


def leave(code: int) -> NoReturn:
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code if 0 <= code < 256 else 1)


# --- the wire: one JSON object per line; the request's line carries the standard streams' descriptors ---------

class Channel:
    """One connection, read a line (one message) at a time."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self._buffer = b""

    def fileno(self) -> int:
        return self.connection.fileno()

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = (json.dumps(message) + "\n").encode()
        with contextlib.suppress(OSError):  # the other side went away: its reader sees the connection closed
            if fds:
                socket.send_fds(self.connection, [data], fds)
            else:
                self.connection.sendall(data)

    def receive_request(self) -> tuple[dict[str, Any], list[int]]:
        data, fds, _, _ = socket.recv_fds(self.connection, 1 << 16, 3)
        self._buffer = data
        message = self.receive()
        if message is None:
            raise ValueError("the request ended early")
        return message, list(fds)

    def receive(self) -> dict[str, Any] | None:
        """The next message; None when the other side closed the connection."""
        while b"\n" not in self._buffer:
            try:
                more = self.connection.recv(1 << 16)
            except OSError:
                more = b""
            if not more:
                return None
            self._buffer += more
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        self.connection.close()


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m shardtune.launch.rank_server SOCKET_PATH")
    serve(str(Path(argv[0]).resolve()))


if __name__ == "__main__":
    main(sys.argv[1:])
