"""What a run folder says about its run: state, progress and ETA, curves, ranks, errors, checkpoints, commands.

Read from the files the run writes (run_files.py), never from a process: a page reloaded, a server restarted or
another machine looking at a shared folder sees the same. Nothing heavy is imported (no torch, no web stack).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtune import run_files
from shardtune.host import process_alive
from shardtune.launch.failures import is_consequence
from shardtune.web.beneath import AppendedLines, list_beneath, open_beneath, read_text_beneath
from shardtune.web.rank_table import RankLogReader, rank_rows, read_rank_logs

COMPLETE_MARKER = "COMPLETE"  # as train/checkpoint_folders.py writes it
_SKIP_DIRS = {"ranks", "runs", "wandb", "mlruns", "__pycache__", "node_modules"}
MAX_DEPTH = 4
_RANK_ERROR = re.compile(r"rank-[0-9]+-error\.txt")


def find_runs(root: Path) -> list[Path]:
    """Run folders under ``root`` (``root`` itself included), newest first: any folder shardtune trained or is
    training into, started from this page or from the command line."""
    found: list[Path] = []

    def visit(folder: Path, depth: int) -> None:
        if is_run_folder(folder):
            found.append(folder)
        if depth >= MAX_DEPTH:
            return
        with contextlib.suppress(OSError):
            for child in folder.iterdir():
                if child.is_dir() and not child.is_symlink() and not child.name.startswith(".") \
                        and child.name not in _SKIP_DIRS and not child.name.startswith("checkpoint-"):
                    visit(child, depth + 1)

    visit(root, 0)
    return sorted(found, key=_last_change, reverse=True)


def is_run_folder(folder: Path) -> bool:
    return any((folder / name).exists() for name in (run_files.RESOLVED_CONFIG, run_files.LAUNCH_PLAN,
                                                     run_files.WEB_LAUNCH, run_files.LAUNCH_COMMANDS, "ranks"))


def _last_change(folder: Path) -> float:
    times = [0.0]
    for name in (run_files.LOG, run_files.WEB_LAUNCH, run_files.LAUNCH_COMMANDS, run_files.RESULTS, "ranks"):
        with contextlib.suppress(OSError):
            times.append((folder / name).stat().st_mtime)
    return max(times)


def read_json(folder: Path, relative: str) -> Any:
    """The JSON in ``folder/relative``, read without following a symbolic link (beneath.py); None when unreadable."""
    try:
        return json.loads(read_text_beneath(folder, relative))
    except (OSError, ValueError):
        return None


class CurveReader:
    """Loss, learning rate, eval loss and grad norm by step from rank 0's ``trainer_log.jsonl``, read as it grows."""

    def __init__(self, folder: Path) -> None:
        self.lines = AppendedLines(folder, run_files.LOG)
        self.points: dict[str, list[list[float]]] = {}

    def read(self) -> dict[str, list[list[float]]]:
        new, restarted = self.lines.read()
        if restarted or not self.points:
            self.points = {"loss": [], "learning_rate": [], "eval_loss": [], "grad_norm": []}
        for line in new:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            step = record.get("current_steps") if isinstance(record, dict) else None
            for key, values in self.points.items():
                if isinstance(step, (int, float)) and isinstance(record.get(key), (int, float)):
                    values.append([step, record[key]])
        return {key: list(values) for key, values in self.points.items()}  # a copy: the next read appends


@dataclass
class RunWatcher:
    """Keeps a run's readers between looks, so a live page reads only what was appended (2 ranks x 50k steps:
    docs/watching.md). One look at a time: the page's requests run in a thread pool and share the readers."""

    folder: Path
    readers: dict[Path, RankLogReader] = field(default_factory=dict)
    curve_reader: CurveReader | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def summary(self, now: float | None = None) -> dict[str, Any]:
        with self.lock:
            return run_summary(self.folder, read_rank_logs(self.folder / "ranks", self.readers), now)

    def curves(self) -> dict[str, list[list[float]]]:
        with self.lock:
            self.curve_reader = self.curve_reader or CurveReader(self.folder)
            return self.curve_reader.read()


def run_summary(folder: Path, ranks: list[RankLogReader], now: float | None = None) -> dict[str, Any]:
    """Everything the table and the page show of a run, as plain data."""
    now = time.time() if now is None else now
    launch = read_json(folder, run_files.LAUNCH_COMMANDS) or {}
    web = read_json(folder, run_files.WEB_LAUNCH) or {}
    started = min([t for t in (launch.get("started"), web.get("started")) if t] or
                  [min((r.start["time"] for r in ranks if r.start), default=0.0)])
    results = read_json(folder, run_files.RESULTS)
    if results is not None and _mtime(folder / run_files.RESULTS) < started:
        results = None  # an earlier attempt's
    errors = rank_errors(folder, started)
    state = run_state(ranks, results, errors, web, now)
    over = state in ("finished", "failed", "stopped", "exited")
    total = max([int(r.start["total_steps"]) for r in ranks if r.start] or [0])
    step = max([r.step for r in ranks] or [int(results["global_step"]) if results else 0])
    step_times = [v for r in ranks if (v := r.step_seconds()) is not None]
    eta = statistics.median(step_times) * max(total - step, 0) if step_times and not over else None
    return {
        "name": folder.name, "state": state, "step": step, "total_steps": total,
        "percent": round(100 * step / total, 1) if total else None, "eta_seconds": eta,
        "elapsed_seconds": (now if not over else _end_time(ranks, now)) - started if started else None,
        "started": started or None, "ranks": rank_rows(ranks, now, over), "errors": errors,
        "results": results, "checkpoints": checkpoints(folder, launch), "launch": launch, "web_launch": web,
        "console_tail": console_tail(folder), "world_size": max([r.start["world_size"] for r in ranks if r.start]
                                                                 or [0]),
    }


def _end_time(ranks: list[RankLogReader], now: float) -> float:
    return max([r.last["time"] for r in ranks if r.last and "time" in r.last] or [now])


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def run_state(ranks: list[RankLogReader], results: Any, errors: list[dict[str, Any]], web: dict[str, Any],
              now: float) -> str:
    """starting, running, stalled, finished, stopped, failed, or exited (ended with no word why)."""
    if results is not None and all(r.ended for r in ranks):
        return "finished"
    if errors:
        return "failed"
    if ranks and all(r.ended for r in ranks):
        return "stopped" if any(r.last and r.last.get("interrupted") for r in ranks) else "finished"
    exit_code = web.get("exit_code")
    if exit_code is not None:
        return "failed" if exit_code not in (0, 130) else ("stopped" if exit_code == 130 else "exited")
    alive = [process_alive(r.start.get("pid"), r.start.get("host"), r.start.get("time")) for r in ranks if r.start]
    if ranks and alive and not any(a is not False for a in alive):
        return "exited"  # every rank process on this host is gone without an end record: killed
    if not ranks:
        launcher = process_alive(web.get("pid"), web.get("host"), web.get("started"))
        return "starting" if launcher else ("exited" if web else "unknown")
    rows = rank_rows(ranks, now, False)
    return "stalled" if any(row["stalled"] for row in rows) else "running"


def rank_errors(folder: Path, since: float) -> list[dict[str, Any]]:
    """Each rank's own error file written for this attempt: its one-line summary and its traceback.
    A rank's own error first; ranks that only lost a peer after it last."""
    found = []
    errors = Path(run_files.RANK_ERROR).parent
    for name in sorted(n for n in list_beneath(folder, errors) if _RANK_ERROR.fullmatch(n)):
        try:
            with open_beneath(folder, errors / name) as f:
                if os.fstat(f.fileno()).st_mtime < since - 1:
                    continue
                summary, _, details = f.read().decode("utf-8", errors="replace").partition("\n\n")
        except OSError:
            continue
        path, rank = folder / errors / name, int(name.split("-")[1])
        if not summary.strip():  # a report another shardtune wrote in place, read before its line: next poll
            continue
        found.append({"rank": rank, "summary": summary.strip(), "traceback": details[-20000:],
                      "file": str(path), "consequence": is_consequence(summary)})
    return sorted(found, key=lambda e: (e["consequence"], e["rank"]))


def console_tail(folder: Path, lines: int = 40) -> list[str]:
    """The end of a page-started run's console log (what the launching host printed)."""
    try:
        text = read_text_beneath(folder, run_files.CONSOLE_LOG, limit=16384)
    except OSError:
        return []
    return [line.rsplit("\r", 1)[-1] for line in text.splitlines()[-lines:]]


def checkpoints(folder: Path, launch: dict[str, Any]) -> list[dict[str, Any]]:
    """Every checkpoint-<step> folder: complete or not (interrupted mid-save), its size, the command resuming it."""
    found = []
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            # Not a link: the size below would be summed over wherever it leads.
            if not (path.is_dir() and not path.is_symlink() and path.name.startswith("checkpoint-")
                    and path.name[11:].isdigit()):
                continue
            complete = (path / COMPLETE_MARKER).is_file()
            found.append({"name": path.name, "step": int(path.name[11:]), "complete": complete,
                          "size_bytes": folder_size(path), **save_times(path),
                          "resume_command": resume_command(folder, path, launch) if complete else None})
    return sorted(found, key=lambda c: c["step"])


def save_times(checkpoint: Path) -> dict[str, Any]:
    """What the save held training for and how long its files took, as rank 0's marker records them (empty for a
    checkpoint written before the marker held them, or not complete)."""
    with contextlib.suppress(OSError, ValueError):
        marker = json.loads((checkpoint / COMPLETE_MARKER).read_text(encoding="utf-8"))
        if isinstance(marker, dict):
            return {key: marker[key] for key in ("async_save", "blocked_seconds", "write_seconds")
                    if isinstance(marker.get(key), (bool, int, float))}
    return {}


def folder_size(path: Path) -> int:
    total = 0
    for item in path.rglob("*"):
        with contextlib.suppress(OSError):
            if item.is_file() and not item.is_symlink():
                total += item.stat().st_size
    return total


def resume_command(folder: Path, checkpoint: Path, launch: dict[str, Any]) -> str:
    """The run's own command line with resume_from_checkpoint added (its resolved config when unknown)."""
    args = launch.get("command_line")
    if not args:
        args = [str(folder.resolve() / run_files.RESOLVED_CONFIG)]
    args = [a for a in args if not a.startswith(("resume_from_checkpoint=", "overwrite_output_dir="))]
    command = shlex.join(["shardtune", "train", *args, f"resume_from_checkpoint={checkpoint.resolve()}",
                          "overwrite_output_dir=false"])
    prefix = _env_prefix(launch)
    cwd = launch.get("cwd")
    return (f"cd {shlex.quote(cwd)} && " if cwd else "") + prefix + command


def _env_prefix(launch: dict[str, Any]) -> str:
    nodes, procs = launch.get("nnodes") or 1, launch.get("nproc_per_node") or 1
    if nodes > 1:
        return (f"NNODES={nodes} NODE_RANK=<node> MASTER_ADDR={launch.get('master_addr')} "
                f"MASTER_PORT={launch.get('master_port')} NPROC_PER_NODE={procs} ")
    return f"NPROC_PER_NODE={procs} " if procs > 1 else ""


def node_commands(launch: dict[str, Any]) -> list[dict[str, Any]]:
    """For each node: what to run on it (shardtune train with its NODE_RANK) and the torchrun command it starts."""
    if not launch:
        return []
    args = launch.get("command_line") or []
    nodes = launch.get("nnodes") or 1
    torchrun = launch.get("torchrun") or []
    out = []
    for node in range(nodes):
        env = {"NNODES": nodes, "NODE_RANK": node, "MASTER_ADDR": launch.get("master_addr"),
               "MASTER_PORT": launch.get("master_port"), "NPROC_PER_NODE": launch.get("nproc_per_node")}
        prefix = " ".join(f"{k}={v}" for k, v in env.items()) if nodes > 1 else _env_prefix(launch).strip()
        out.append({"node": node, "shardtune": (prefix + " " if prefix else "") + shlex.join(["shardtune", "train",
                                                                                            *args]),
                    "torchrun": torchrun[node] if node < len(torchrun) else None})
    return out


def config_of(folder: Path) -> dict[str, Any] | None:
    """The resolved config the run trained with (from the launch plan while the ranks start)."""
    config = read_json(folder, run_files.RESOLVED_CONFIG)
    if config is None:
        plan = read_json(folder, run_files.LAUNCH_PLAN)
        config = plan.get("config") if isinstance(plan, dict) else None
    return config if isinstance(config, dict) else None


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """The keys whose values differ between two resolved configs."""
    return [{"key": key, "a": a.get(key), "b": b.get(key)} for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key)]


def curves(folder: Path) -> dict[str, list[list[float]]]:
    """Loss, learning rate and eval loss by step, as rank 0 logged them (trainer_log.jsonl)."""
    return CurveReader(folder).read()
