"""What the per-rank step logs (ranks/rank_<R>.jsonl, train/rank_log.py) cost each step, against the step time.

Two measurements, recorded with the machine under results/rank_log_overhead.{md,json}:
* the cost of one record (RankLog.step: the JSON line, its flush, the resident-memory read), timed call by call
  on a record of a real run's shape (median and 99th percentile of ``--calls`` calls);
* the median step time of real 2-process CPU runs (`shardtune train`, DDP, the tiny model and a ~6M-parameter one),
  read from those runs' own rank logs; the smallest model's step is the worst case for the ratio.

    .venv/bin/python benchmarks/rank_log_overhead.py [--steps 40] [--calls 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import machine, machine_line  # noqa: E402

from shardtune.model.tiny import build_tiny_model  # noqa: E402
from shardtune.train.rank_log import RankLog  # noqa: E402

MODELS = {"tiny (2 layers, hidden 64)": {}, "wider (6 layers, hidden 256, ~6M parameters)":
          {"hidden": 256, "layers": 6, "heads": 4, "intermediate": 1024}}


def record_cost(calls: int) -> dict[str, float]:
    """Seconds per RankLog.step call, timed one by one."""
    metrics = {"loss": 7.123456, "local_tokens": 812.0, "data_seconds": 0.00123, "sync_seconds": 0.00456,
               "grad_norm": 1.5, "tokens": 1624.0}
    with tempfile.TemporaryDirectory() as folder:
        log = RankLog(Path(folder) / "rank_0.jsonl", 0)
        log.start(world_size=2, total_steps=calls, start_step=0, estimate_peak_bytes=1e9)
        times = []
        for step in range(1, calls + 1):
            started = time.perf_counter()
            log.step(step, metrics, 0.0001)
            times.append(time.perf_counter() - started)
        log.close(calls, interrupted=False)
    times.sort()
    return {"median_s": statistics.median(times), "p99_s": times[int(0.99 * len(times))],
            "mean_s": statistics.mean(times)}


def step_times(model_dir: Path, steps: int, out: Path) -> list[float]:
    """Per-step wall times (data loading included) of a 2-process DDP run, from its rank logs."""
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    done = subprocess.run([sys.executable, "-m", "shardtune", "train", "examples/tiny/sft_full.yaml",
                           f"model_name_or_path={model_dir}", f"output_dir={out}", f"max_steps={steps}",
                           "save_steps=100000", "do_eval=false", "plot_loss=false", "logging_steps=10"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    found = []
    for rank in (0, 1):
        records = [json.loads(line) for line in (out / "ranks" / f"rank_{rank}.jsonl").read_text().splitlines()]
        found += [r["step_s"] for r in records if r.get("event") == "step" and r["step"] > 2]  # after warm-up
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--calls", type=int, default=5000)
    ns = parser.parse_args()
    cost = record_cost(ns.calls)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, shape in MODELS.items():
            model = build_tiny_model(Path(folder) / f"model-{len(rows)}", **shape)
            times = step_times(model, ns.steps, Path(folder) / f"run-{len(rows)}")
            median = statistics.median(times)
            rows.append({"model": name, "median_step_s": median, "steps_measured": len(times),
                         "overhead_percent": 100 * cost["median_s"] / median,
                         "overhead_percent_p99": 100 * cost["p99_s"] / median})
    info = machine()
    result = {"command": "benchmarks/rank_log_overhead.py " + " ".join(sys.argv[1:]), "machine": info,
              "record_cost": cost, "runs": rows, "calls": ns.calls, "steps": ns.steps}
    results = REPO / "benchmarks" / "results"
    (results / "rank_log_overhead.json").write_text(json.dumps(result, indent=2))
    lines = ["# Per-rank step log overhead", "", f"Command: `.venv/bin/python {result['command'].strip()}`", "",
             machine_line(info), "",
             f"One record (RankLog.step, {ns.calls} calls): median {cost['median_s'] * 1e6:.1f} us, "
             f"99th percentile {cost['p99_s'] * 1e6:.1f} us, mean {cost['mean_s'] * 1e6:.1f} us.", "",
             "| regime (2 CPU processes, DDP, full SFT, micro-batch 4 x 2 accumulation, cutoff 256) | median step | "
             "steps | record / step (median) | record / step (p99) |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['median_step_s'] * 1000:.1f} ms | {r['steps_measured']} | "
              f"{r['overhead_percent']:.3f} % | {r['overhead_percent_p99']:.3f} % |" for r in rows]
    (results / "rank_log_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
