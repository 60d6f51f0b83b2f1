"""glibc's mmap threshold on CPU ranks: the side by side's shardtune run (``llamafactory_cpu.py``'s YAML, 2
processes, DDP LoRA) with the launcher's default, where an engine that gathers nothing keeps glibc's adaptive
threshold, against a fixed 128 KiB threshold (the one the launcher set for FSDP and ZeRO-3 until 2026-11-30, 64 KiB
since: gather_mmap_threshold_cpu.py), given here in the environment, which the launcher leaves as it is.
Interleaved pairs; per run the loop's time (``train_runtime``), the wall time and the minor page faults of the
whole process tree (``getrusage``).

    .venv/bin/python benchmarks/mmap_threshold_cpu.py --repeats 3 --steps 120
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamafactory_cpu import SHARDTUNE, prepare  # noqa: E402

FIXED = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def run_once(config: Path, work: Path, procs: int, extra_env: dict[str, str]) -> dict:
    out = work / "runs" / "mmap-threshold"
    shutil.rmtree(out, ignore_errors=True)
    inherited = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}  # each run sets its own
    env = {**inherited, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(procs), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", **extra_env}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([*SHARDTUNE, "train", str(config), f"output_dir={out}"], cwd=work, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])
    results = json.loads((out / "train_results.json").read_text())
    return {"loop_seconds": results["train_runtime"], "wall_seconds": round(wall, 3),
            "minor_faults": after.ru_minflt - before.ru_minflt, "train_loss": results.get("train_loss")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardtune-bench-llamafactory"))
    args = parser.parse_args(argv)
    config = prepare(args.work_dir, 2, 64, args.steps)
    runs: dict[str, list[dict]] = {"adaptive (default)": [], "fixed 128 KiB": []}
    for repeat in range(args.repeats):
        for name, extra in (("adaptive (default)", {}), ("fixed 128 KiB", FIXED)):
            runs[name].append(run_once(config, args.work_dir, args.procs, extra))
            print(f"[{repeat + 1}/{args.repeats}] {name}: {runs[name][-1]}", flush=True)
    for name, found in runs.items():
        print(f"{name}: loop median {statistics.median(r['loop_seconds'] for r in found):.2f} s, wall median "
              f"{statistics.median(r['wall_seconds'] for r in found):.2f} s, minor faults median "
              f"{statistics.median(r['minor_faults'] for r in found):,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
