"""`shardtune status OUTPUT_DIR`: a run's progress, ETA, one row per rank, stragglers and its last error, in the
terminal (for a machine without a browser); ``--watch`` redraws it."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from shardtune.arguments import CommandParser, positive_seconds
from shardtune.errors import ConfigError
from shardtune.launch.run_lock import read_holder
from shardtune.paths import folder_problem
from shardtune.web.runs import RunWatcher, find_runs, is_run_folder


def status_command(args: list[str]) -> int:
    parser = CommandParser(prog="shardtune status",
                                     description="Progress, ETA, every rank's step, memory and heartbeat, "
                                                 "stragglers and the last error of a run, read from its folder.")
    parser.add_argument("output_dir", help="the run's output_dir (or a folder of runs: each one is listed)")
    parser.add_argument("--watch", type=positive_seconds, metavar="SECONDS",
                        help="redraw every SECONDS until the run ends")
    parser.add_argument("--json", action="store_true", help="the same as JSON")
    ns = parser.parse_args(args)
    folder = Path(ns.output_dir)
    problem = folder_problem("status", ns.output_dir, "a run's output_dir (or a folder of runs)")
    if problem:
        raise ConfigError(problem)
    if not is_run_folder(folder):
        runs = find_runs(folder)
        if not runs:
            raise ConfigError(f"status: no shardtune run in {folder} (no ranks/, {folder}/.shardtune or "
                              "shardtune_config.json)")
        for run in runs:
            summary = RunWatcher(run).summary()
            print(f"{run}: {summary['state']}, {_progress(summary)}")
        return 0
    watcher = RunWatcher(folder)
    while True:
        summary = watcher.summary()
        if ns.json:
            import json

            print(json.dumps(summary, default=str))
        else:
            if ns.watch:
                sys.stdout.write("\x1b[2J\x1b[H")  # clear the screen for the redraw
            print(format_status(folder, summary))
        if not ns.watch or summary["state"] in ("finished", "failed", "stopped", "exited"):
            return 1 if summary["state"] == "failed" else 0
        time.sleep(ns.watch)


def format_status(folder: Path, s: dict[str, Any]) -> str:
    lines = [f"run {folder} ({s['name']}): {s['state']}", f"  {_progress(s)}"]
    lock = lock_line(folder)
    if lock:
        lines.append(f"  {lock}")
    if s["ranks"]:
        lines += ["", *_table(s["ranks"])]
    stragglers = [str(r["rank"]) for r in s["ranks"] if r["straggler"]]
    stalled = [str(r["rank"]) for r in s["ranks"] if r["stalled"]]
    if stragglers:
        lines.append(f"stragglers: rank {', '.join(stragglers)} (own time per step over 1.3x the median)")
    if stalled:
        lines.append(f"stalled: rank {', '.join(stalled)} (no record for a long time)")
    if s["errors"]:
        first = s["errors"][0]
        lines += ["", f"last error: {first['summary']}", f"  (full traceback: {first['file']})"]
    done = [c for c in s["checkpoints"] if c["complete"]]
    if done:
        lines.append(f"checkpoints: {', '.join(c['name'] for c in done)}; resume the latest with:")
        lines.append(f"  {done[-1]['resume_command']}")
    return "\n".join(lines)


def lock_line(folder: Path) -> str | None:
    """Who holds the run's lock (launch/run_lock.py): the live run a second `train` into this folder would meet."""
    holder = read_holder(folder)
    if holder is None:
        return None
    if holder.alive():
        return f"held by {holder.describe()} (run lock: another train into this folder is refused)"
    return f"run lock left by {holder.describe()}, which no longer runs (the next train takes it over)"


def _progress(s: dict[str, Any]) -> str:
    parts = [f"step {s['step']}/{s['total_steps'] or '?'}"]
    if s["percent"] is not None:
        parts[0] += f" ({s['percent']:.1f}%)"
    if s["elapsed_seconds"] is not None:
        parts.append(f"elapsed {format_duration(s['elapsed_seconds'])}")
    if s["eta_seconds"] is not None:
        parts.append(f"ETA {format_duration(s['eta_seconds'])}")
    losses = [r["loss"] for r in s["ranks"] if r["loss"] is not None]
    if losses:
        parts.append(f"loss {losses[0]:.4f}")
    elif s["results"] and s["results"].get("final_loss") is not None:
        parts.append(f"final loss {s['results']['final_loss']:.4f}")
    return ", ".join(parts)


_COLUMNS = ("rank", "host", "pid", "step", "step s", "own s", "wait s", "data s", "tokens/s", "memory", "heartbeat",
            "flags")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cells = [list(_COLUMNS)] + [[str(r["rank"]), str(r["host"] or "-"), str(r["pid"] or "-"), str(r["step"]),
                                 _num(r["step_s"], 3), _num(r["own_s"], 3), _num(r["wait_s"], 3),
                                 _num(r["data_s"], 3), _num(r["tokens_per_s"], 0), _memory(r),
                                 "-" if r["heartbeat_age"] is None else f"{r['heartbeat_age']:.1f} s ago",
                                 _flags(r)] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells]


def _flags(r: dict[str, Any]) -> str:
    flags = [name for name in ("straggler", "stalled") if r[name]]
    if r["phase"]:
        flags.append(r["phase"])
    return ", ".join(flags) or "-"


def _memory(r: dict[str, Any]) -> str:
    if r["mem_allocated"] is not None:
        return f"{format_bytes(r['mem_allocated'])} alloc / {format_bytes(r['mem_peak'])} peak"
    return f"{format_bytes(r['rss'])} rss" if r["rss"] else "-"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
