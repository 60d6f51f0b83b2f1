#!/usr/bin/env python3
"""Wall time of `shardtune check` (and `shardtune --help`): the median of N fresh interpreters each.

  .venv/bin/python benchmarks/check_time.py [--runs 5] [--config examples/tiny/sft_lora.yaml]

Each run is a new process, as a user types it: interpreter start, imports, the whole preflight (config, files,
model folder, data, engine plan, memory verdict). The tiny model is built first if missing, so the check reads a
real model folder. Writes results/check-time.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))

from common import machine, machine_line  # noqa: E402


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--config", default="examples/tiny/sft_lora.yaml")
    args = parser.parse_args()
    shardtune = [sys.executable, "-m", "shardtune"]
    model = REPO / "models" / "tiny-llama"
    if not model.exists():
        subprocess.run([*shardtune, "make-tiny-model", "--out", str(model)], cwd=REPO, check=True,
                       capture_output=True)
    commands = {"shardtune --help": [*shardtune, "--help"], f"shardtune check {args.config}": [*shardtune, "check",
                                                                                            args.config]}
    rows = {}
    for label, argv in commands.items():
        timed(argv)  # warm the file cache and the bytecode once
        times = [timed(argv) for _ in range(args.runs)]
        rows[label] = {"median_s": statistics.median(times), "runs_s": times}
        shown = ", ".join(f"{t:.2f}" for t in times)
        print(f"{label}: median {statistics.median(times):.2f} s of {args.runs} ({shown})")
    info = machine()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "check-time.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    lines = ["# `shardtune check` wall time", "", f"Command: `.venv/bin/python benchmarks/check_time.py --runs "
             f"{args.runs}`", "", machine_line(info), "", "| command | median | runs |", "|---|---:|---|"]
    lines += [f"| `{label}` | {row['median_s']:.2f} s | {', '.join(f'{t:.2f}' for t in row['runs_s'])} |"
              for label, row in rows.items()]
    (RESULTS / "check-time.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
