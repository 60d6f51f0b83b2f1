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

from shardtune import run_files
from shardtune.config.args import read_config
from shardtune.errors import ConfigError
from shardtune.host import process_alive
from shardtune.web.rank_table import read_rank_logs
from shardtune.web.runs import read_json

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


def parse_launch_request(body: Any) -> LaunchRequest:
    """The form's JSON body as a request; ValueError (one line) for a body the page never sends."""
    if not isinstance(body, dict):
        raise ValueError("the request must be a JSON object with yaml, values and nproc_per_node")
    yaml_text, values, nproc = body.get("yaml") or "", body.get("values") or {}, body.get("nproc_per_node") or 1
    if not isinstance(yaml_text, str):
        raise ValueError("yaml: must be the config's text")
    if not isinstance(values, dict) or not all(isinstance(k, str) and k.isidentifier() for k in values):
        raise ValueError("values: must map config keys to their values")
    if isinstance(nproc, str) and nproc.strip().isdigit():
        nproc = int(nproc)
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise ValueError(f"nproc_per_node ({nproc!r}): processes per node must be a whole number from 1 to 64")
    return LaunchRequest(yaml_text, {k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}, nproc)


@dataclass(frozen=True)
class CheckResult:
    """`shardtune check` on a request: every problem with the key it names, what check printed when it passed, and
    the run folder the request trains into (None when it cannot be told)."""

    problems: list[dict[str, Any]]
    verdict: str
    output_dir: Path | None


def resolved_output_dir(request: LaunchRequest, config_path: Path, root: Path) -> tuple[Path | None, list[str]]:
    """output_dir as `shardtune train` reads this request when run from ROOT: the YAML in either spelling, the form's
    key=value overrides over it, ``~`` and ``$VAR`` expanded by the same loader (config/args.py), then relative to
    ROOT with symbolic links resolved; or the problems that keep it from being known."""
    try:
        config, _, problems = read_config(request.argv(config_path))
    except ConfigError as err:
        return None, err.problems
    own = [p.text for p in problems if p.key == "output_dir"]
    if own:
        return None, own
    if not config.output_dir:
        return None, ["output_dir is required (where the model and logs are written)"]
    try:
        return (root / config.output_dir).resolve(), []
    except (OSError, RuntimeError) as err:  # a loop of links (RuntimeError before Python 3.13)
        return None, [f"output_dir ({config.output_dir}): cannot be resolved: {err}"]


def request_problems(request: LaunchRequest, root: Path, config_path: Path) -> tuple[Path | None, list[str]]:
    """What the page refuses before even asking `shardtune check`, and the request's output_dir."""
    problems = []
    if not 1 <= request.nproc_per_node <= 64:
        problems.append(f"nproc_per_node ({request.nproc_per_node}): processes per node must be 1 to 64")
    out, out_problems = resolved_output_dir(request, config_path, root)
    problems += out_problems
    if out is not None and not out.is_relative_to(root.resolve()):
        problems.append(f"output_dir ({out}) is outside {root}: runs started from this page are kept under it, "
                        "so the page can show them")
    return out, [p.replace(f"{config_path}", "config") for p in problems]


def check_request(request: LaunchRequest, root: Path, scratch: Path) -> CheckResult:
    """`shardtune check` on the request, exactly as the command line runs it."""
    scratch.mkdir(parents=True, exist_ok=True)
    config = scratch / f"check-{os.getpid()}-{threading.get_ident()}.yaml"
    config.write_text(request.yaml_text or "{}\n", encoding="utf-8")
    try:
        out, problems = request_problems(request, root, config)
        if problems:
            return CheckResult([{"key": key_of(p), "problem": p} for p in problems], "", out)
        done = subprocess.run([sys.executable, "-m", "shardtune", "check", *request.argv(config)], cwd=root,
                              env=_run_env(request), capture_output=True, text=True, timeout=CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        return CheckResult([{"key": None, "problem": f"shardtune check took over {CHECK_TIMEOUT} s"}], "", None)
    finally:
        config.unlink(missing_ok=True)
    if done.returncode == 0:
        return CheckResult([], done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "ok", out)
    lines = [line.removeprefix("shardtune: error: ").replace(f"{config}: ", "config: ")
             for line in done.stderr.splitlines()
             if line.startswith("shardtune: error: ")] or [done.stderr.strip()[-2000:] or "check failed"]
    return CheckResult([{"key": key_of(line), "problem": line} for line in lines], "", out)


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


def launch_detached(request: LaunchRequest, root: Path, out: Path) -> Path:
    """Start `shardtune train` for a checked request in its own session; its output goes to the run folder ``out``
    (check_request's output_dir)."""
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
    threading.Thread(target=_record_exit, args=(proc, out), daemon=True).start()
    return out


def _record_exit(proc: subprocess.Popen, out: Path) -> None:
    """Reap the launching process and keep its exit code (while this server lives; the folder says the rest)."""
    code = proc.wait()
    record = read_json(out, run_files.WEB_LAUNCH) or {}
    if record.get("pid") == proc.pid:
        write_json(out / run_files.WEB_LAUNCH, {**record, "exit_code": code, "ended": time.time()})


def write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


def run_processes(folder: Path) -> dict[int, str]:
    """This host's processes of the run in ``folder`` (pid -> what it is): its page-started launcher, its ranks,
    and any process whose command line names the run's launch plan or page config (torchrun, a stray rank)."""
    found: dict[int, str] = {}
    web = read_json(folder, run_files.WEB_LAUNCH) or {}
    if process_alive(web.get("pid"), web.get("host"), web.get("started")):
        found[web["pid"]] = "launcher"
    for reader in read_rank_logs(folder / "ranks"):
        start = reader.start or {}
        if not reader.ended and process_alive(start.get("pid"), start.get("host"), start.get("time")):
            found[start["pid"]] = f"rank {reader.rank}"
    launch = read_json(folder, run_files.LAUNCH_COMMANDS) or {}
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
