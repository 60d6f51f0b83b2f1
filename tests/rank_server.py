"""The test session's rank server (src/shardtune/launch/rank_server.py): one process that imported the stack, forking
the CLI runs of ``run_cli`` and the ranks of their launches, so that a cell pays for training, not for imports.

Started at the first ``run_cli`` of the session, stopped at its end. ``SHARDTUNE_TEST_LAUNCH=real`` runs every cell
with real launches instead (`python -m shardtune`, torchrun): a failing cell is rerun alone that way with

    SHARDTUNE_TEST_LAUNCH=real .venv/bin/python -m pytest 'tests/...::test_name[cell]'

Tests whose subject is the launch itself (torchrun, accelerate, the deepspeed launcher, Ray, Slurm, signals and
failure handling) start their processes themselves and never come here; so do those that measure a process's memory
(a fork shares its parent's pages) — they are marked ``real_launch``.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from tests.conftest import REPO, cli_env

_SERVER: dict[str, object] = {}
READY_WITHIN_SECONDS = 180
REAL_LAUNCHES: list[bool] = []  # set by the real_launch marker for the test that runs now (conftest)


def wanted() -> bool:
    return os.environ.get("SHARDTUNE_TEST_LAUNCH", "served") != "real" and not (REAL_LAUNCHES and REAL_LAUNCHES[-1])


def server_address() -> str | None:
    """The session's server (started here the first time), None when it could not start."""
    if "address" in _SERVER:
        return _SERVER["address"]  # type: ignore[return-value]
    folder = Path(tempfile.mkdtemp(prefix="shardtune-rank-server-"))
    address = str(folder / "server.sock")
    log = open(folder / "server.log", "w+")  # noqa: SIM115 - kept for the session
    process = subprocess.Popen([sys.executable, "-m", "shardtune.launch.rank_server", address], cwd=REPO,
                               env=cli_env(), stdout=subprocess.PIPE, stderr=log, text=True)
    _SERVER.update(process=process, folder=folder)  # stopped by conftest's cleanup (stop)
    ready = select.select([process.stdout], [], [], READY_WITHIN_SECONDS)[0]
    line = process.stdout.readline() if ready else ""  # type: ignore[union-attr]  # "ready PID", or "" at its end
    _SERVER["address"] = address if line.startswith("ready") else None
    if _SERVER["address"] is None:
        log.seek(0)
        print(f"rank server did not start ({log.read()[-2000:]}); real launches for this session", file=sys.stderr)
        stop()
    return _SERVER["address"]  # type: ignore[return-value]


def stop() -> None:
    """Stop the session's server (when one was started) and remove its folder."""
    process, folder = _SERVER.pop("process", None), _SERVER.pop("folder", None)
    if isinstance(process, subprocess.Popen) and process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
    if isinstance(folder, Path):
        shutil.rmtree(folder, ignore_errors=True)


def run_cli_on_server(argv: list[str], env: dict[str, str], cwd: Path, timeout: float
                      ) -> subprocess.CompletedProcess | None:
    """``python -m shardtune ARGV`` forked by the server, as ``subprocess.run(..., capture_output=True, text=True)``
    reports it; None when it must be a real launch."""
    address = server_address() if wanted() else None
    if address is None:
        return None
    command = [sys.executable, "-m", "shardtune", *argv]
    served = _run_on_server(address, ["-m", "shardtune", *argv], [{**env, "SHARDTUNE_RANK_SERVER": address}], cwd,
                            timeout, command)
    if served is None:
        return None
    (code,), stdout, stderr = served
    return subprocess.CompletedProcess(command, code, stdout, stderr)


# What cells left behind (processes still running when they ended, files in the temporary folder, which is the test
# process's own: conftest's pytest_configure): the test that ran them fails (conftest's _launch_kind).
LEAKS: list[str] = []


def run_python(args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True)`` for a test's own worker: `python FILE ARGS`, or
    `python -m torch.distributed.run --standalone --nproc-per-node=N FILE ARGS` (N ranks with the environment
    torchrun gives them, their streams shared as under torchrun; exit code 1 when any failed, as torchrun's).
    Forked by the server when it can serve them, else run as given."""
    ranks, script = _worker_launch(args)
    address = server_address() if wanted() and script is not None else None
    served = None
    if address is not None and script is not None:
        from shardtune.launch.served import rank_environments
        from shardtune.launch.torchrun import find_free_port

        envs = rank_environments(env, ranks, "127.0.0.1", find_free_port(), "test") if ranks else [env]
        served = _run_on_server(address, args[args.index(script):], envs, cwd, timeout, args)
    if served is None:
        return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    codes, stdout, stderr = served
    code = codes[0] if not ranks else (0 if all(c == 0 for c in codes) else 1)
    return subprocess.CompletedProcess(args, code, stdout, stderr)


def _worker_launch(args: list[str]) -> tuple[int, str | None]:
    """(ranks under torchrun, 0 for a plain script; the script) of a worker command, (0, None) for anything else."""
    if len(args) >= 2 and args[0] == sys.executable and args[1].endswith(".py"):
        return 0, args[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if args[:4] == torchrun and len(args) > 5 and args[4].startswith("--nproc-per-node=") and args[5].endswith(".py"):
        return int(args[4].split("=", 1)[1]), args[5]
    return 0, None


def _run_on_server(address: str, program: list[str], envs: list[dict[str, str]], cwd: Path, timeout: float,
                   command: list[str]) -> tuple[list[int], str, str] | None:
    """``program`` once per environment on the server, their output captured: (their exit codes, stdout, stderr),
    what they left behind noted in ``LEAKS``; None when the server refused; subprocess.TimeoutExpired, all of them
    killed, after ``timeout`` seconds."""
    import threading

    from shardtune.launch.served import RankGroup, ServerRefused, run_served_ranks

    group = RankGroup()
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        group.kill_all()

    temporary = set(os.listdir(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix="shardtune-cell-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        with open(os.devnull) as stdin, open(out, "w") as out_file, open(err, "w") as err_file:
            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                codes = run_served_ranks(address, envs, program, str(cwd),
                                         (stdin.fileno(), out_file.fileno(), err_file.fileno()), group)
            except ServerRefused as refused:  # a real launch instead: slower, so said (pytest's warnings summary)
                warnings.warn(f"rank server refused {' '.join(command)[:120]}: {refused}", stacklevel=2)
                return None
            finally:
                timer.cancel()
        stdout, stderr = (path.read_bytes().decode("utf-8", "replace") for path in (out, err))
    if fired.is_set():
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    note_leaks(command, group.ranks, stderr, sorted(set(os.listdir(tempfile.gettempdir())) - temporary))
    return codes, stdout, stderr


def note_leaks(command: list[str], processes: list, stderr: str, left_files: list[str]) -> None:
    """Adds to ``LEAKS`` what a served command left: processes its handlers killed after it (theirs, or those a
    ``train`` among them reported of its ranks) and files in the temporary folder."""
    from shardtune.launch.served import LEFT_RUNNING

    left_running = [name for process in processes for name in process.left_running]
    left_by_ranks = [line for line in stderr.splitlines() if line.startswith(LEFT_RUNNING)]
    if left_running or left_by_ranks or left_files:
        LEAKS.append(f"{' '.join(command)[:160]}: left running {left_running} {left_by_ranks}, left in "
                     f"{tempfile.gettempdir()}: {left_files}")
