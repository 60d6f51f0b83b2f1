"""Start a run from the page, detached from the server, and stop every process of a run.

A run started here is `shardtune train` in its own session with its output in the run folder: closing the page or
restarting the server changes nothing for it, and the page finds it again from the folder. Stop sends SIGTERM to
the launching process and to every rank this host runs (each rank finishes its step and saves, as on Ctrl-C), waits,
and then checks that no process of the run is left (the ones that outlive the grace period are killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shardtune import run_files
from shardtune.web.rank_table import read_rank_logs
from shardtune.web.runs import process_alive, read_json

CHECK_TIMEOUT = 300
STOP_GRACE_SECONDS = 120.0
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class LaunchRequest:
    """What the form sends: a YAML text, key=value overrides, and processes per node."""

    yaml_text: str
    values: dict[str, str]
    nproc_per_node: int = 1

    def argv(self, config_path: Path) -> list[str]:
        return [str(config_path), *(f"{key}={value}" for key, value in self.values.items() if value != "")]

    def output_dir(self, root: Path) -> Path | None:
        raw = self.values.get("output_dir") or (self.parsed().get("output_dir") if self.parsed() else None)
        if not raw:
            return None
        path = Path(str(raw))
        return (path if path.is_absolute() else root / path).resolve()

    def parsed(self) -> dict[str, Any]:
        try:
            data = yaml.safe_load(self.yaml_text) if self.yaml_text.strip() else {}
        except yaml.YAMLError:
            return {}
        return data if isinstance(data, dict) else {}


def request_problems(request: LaunchRequest, root: Path) -> list[str]:
    """What the page refuses before even asking `shardtune check`."""
    problems = []
    try:
        data = yaml.safe_load(request.yaml_text) if request.yaml_text.strip() else {}
        if not isinstance(data, dict):
            problems.append("config: the YAML must be a mapping of keys to values")
    except yaml.YAMLError as err:
        problems.append(f"config: not valid YAML: {str(err).splitlines()[0]}")
    out = request.output_dir(root)
    if out is None:
        problems.append("output_dir is required (where the model and logs are written)")
    elif not out.is_relative_to(root.resolve()):
        problems.append(f"output_dir ({out}) is outside {root}: runs started from this page are kept under it, "
                        "so the page can show them")
    if not 1 <= request.nproc_per_node <= 64:
        problems.append(f"nproc_per_node ({request.nproc_per_node}): processes per node must be 1 to 64")
    return problems


def check_request(request: LaunchRequest, root: Path, scratch: Path) -> tuple[list[dict[str, Any]], str]:
    """`shardtune check` on the request, exactly as the command line runs it; every problem with the key it names
    (None when it names none), and what check printed when it passed."""
    problems = request_problems(request, root)
    if problems:
        return [{"key": key_of(p), "problem": p} for p in problems], ""
    scratch.mkdir(parents=True, exist_ok=True)
    config = scratch / f"check-{os.getpid()}-{threading.get_ident()}.yaml"
    config.write_text(request.yaml_text or "{}\n", encoding="utf-8")
    try:
        done = subprocess.run([sys.executable, "-m", "shardtune", "check", *request.argv(config)], cwd=root,
                              env=_run_env(request), capture_output=True, text=True, timeout=CHECK_TIMEOUT)
    finally:
        config.unlink(missing_ok=True)
    if done.returncode == 0:
        return [], done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "ok"
    lines = [line.removeprefix("shardtune: error: ").replace(f"{config}: ", "config: ")
             for line in done.stderr.splitlines()
             if line.startswith("shardtune: error: ")] or [done.stderr.strip()[-2000:] or "check failed"]
    return [{"key": key_of(line), "problem": line} for line in lines], ""


def key_of(problem: str) -> str | None:
    """The config key a problem line judges: the first key it names (None when it names none)."""
    from shardtune.config.schema import config_fields

    keys = {f.name for f in config_fields()}
    return next((word for word in _WORD.findall(problem) if word in keys), None)


def _run_env(request: LaunchRequest) -> dict[str, str]:
    env = dict(os.environ)
    env["NPROC_PER_NODE"] = str(request.nproc_per_node)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("SHARDTUNE_DEBUG", None)
    return env


def launch_detached(request: LaunchRequest, root: Path) -> Path:
    """Start `shardtune train` for a checked request in its own session; its output goes to the run folder."""
    out = request.output_dir(root)
    assert out is not None, "launch_detached needs a checked request"
    (out / ".shardtune").mkdir(parents=True, exist_ok=True)
    config = out / ".shardtune" / "web_config.yaml"
    config.write_text(request.yaml_text or "{}\n", encoding="utf-8")
    argv = [sys.executable, "-m", "shardtune", "train", *request.argv(config)]
    with open(out / run_files.CONSOLE_LOG, "ab") as console:
        proc = subprocess.Popen(argv, cwd=root, env=_run_env(request), stdin=subprocess.DEVNULL, stdout=console,
                                stderr=subprocess.STDOUT, start_new_session=True)
    record = {"pid": proc.pid, "host": socket.gethostname(), "argv": argv, "cwd": str(root), "started": time.time(),
              "nproc_per_node": request.nproc_per_node, "exit_code": None}
    write_json(out / run_files.WEB_LAUNCH, record)
    threading.Thread(target=_record_exit, args=(proc, out / run_files.WEB_LAUNCH), daemon=True).start()
    return out


def _record_exit(proc: subprocess.Popen, path: Path) -> None:
    """Reap the launching process and keep its exit code (while this server lives; the folder says the rest)."""
    code = proc.wait()
    record = read_json(path) or {}
    if record.get("pid") == proc.pid:
        write_json(path, {**record, "exit_code": code, "ended": time.time()})


def write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


def run_processes(folder: Path) -> dict[int, str]:
    """This host's processes of the run in ``folder`` (pid -> what it is): its page-started launcher, its ranks,
    and any process whose command line names the run's launch plan or page config (torchrun, a stray rank)."""
    found: dict[int, str] = {}
    web = read_json(folder / run_files.WEB_LAUNCH) or {}
    if process_alive(web.get("pid"), web.get("host"), web.get("started")):
        found[web["pid"]] = "launcher"
    for reader in read_rank_logs(folder / "ranks"):
        start = reader.start or {}
        if not reader.ended and process_alive(start.get("pid"), start.get("host"), start.get("time")):
            found[start["pid"]] = f"rank {reader.rank}"
    launch = read_json(folder / run_files.LAUNCH_COMMANDS) or {}
    markers = run_markers(folder, [web.get("cwd"), launch.get("cwd")])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in found or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = b"\0" + (proc / "cmdline").read_bytes()
            if any(m in cmdline for m in markers) and process_alive(int(proc.name), None):  # not a zombie
                found[int(proc.name)] = "run process"
    return found


def run_markers(folder: Path, cwds: list[Any]) -> list[bytes]:
    """How the run's own files appear in its processes' command lines: absolute, or relative to where the run
    was started (torchrun and the ranks get the launch plan's path as the config's output_dir spelled it)."""
    files = [(folder / run_files.LAUNCH_PLAN).resolve(), (folder / ".shardtune" / "web_config.yaml").resolve()]
    spelled = {str(f) for f in files}
    for cwd in cwds:
        if cwd:
            spelled |= {os.path.relpath(f, cwd) for f in files}
    return [b"\0" + s.encode() + b"\0" for s in sorted(spelled)]  # a whole argument, not part of a longer one


def stop_run(folder: Path, grace: float = STOP_GRACE_SECONDS) -> dict[str, Any]:
    """SIGTERM to the run's launcher and ranks on this host, wait for them to save and exit, kill what is left
    after ``grace`` seconds, and report (also written to .shardtune/stop.json for the page)."""
    report: dict[str, Any] = {"requested": time.time(), "signalled": {}, "killed": {}, "remaining": {},
                              "done": False}
    targets = run_processes(folder)
    for pid, what in targets.items():
        if what in ("launcher",) or what.startswith("rank"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                report["signalled"][str(pid)] = what
    write_json(folder / run_files.STOP_REPORT, report)
    deadline = time.time() + grace
    while time.time() < deadline and run_processes(folder):
        time.sleep(0.5)
    for pid, what in run_processes(folder).items():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            report["killed"][str(pid)] = what
    if report["killed"]:
        time.sleep(1.0)
    report.update(remaining={str(p): w for p, w in run_processes(folder).items()}, done=True, finished=time.time())
    write_json(folder / run_files.STOP_REPORT, report)
    return report
