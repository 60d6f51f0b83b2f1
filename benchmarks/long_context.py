"""Peak memory per rank of one long row split over N CPU processes (sequence parallelism), against one process on the
whole row and against the estimate.

    .venv/bin/python benchmarks/long_context.py                    # results to benchmarks/results
    .venv/bin/python benchmarks/long_context.py --out /tmp/lc --tokens 4096

A random LLaMA (4 layers, hidden 256, 8 heads, 4 KV heads, vocabulary 4096: about 5M parameters) continues
pre-training on the bundled text packed into rows of ``--tokens`` tokens (8192 by default), one row per step, full
parameters, fp32 AdamW, 2 steps, through `shardtune train` (``FORCE_TORCHRUN=1 NPROC_PER_NODE=N`` for N > 1), one
run at a time: one process, then sequence_parallel_size 2 on 2 processes and 4 on 4 processes, ulysses and
allgather. Every run computes the same rows (one data-parallel group).

The measured numbers are shardtune's own: ``peak_memory_bytes_per_rank`` of train_results.json (resident memory the
rank gained from before the model was loaded to the end of training), and the step's share of it (that peak less
``peak_setup_memory_bytes_per_rank``, the peak once the model and optimizer were set up): the activations, the
gradients and the optimizer states that the first step creates. The estimate is ``estimated_memory_bytes`` of the
same file (`shardtune estimate`'s model for that run, estimate/activations.py for the split).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import machine, machine_line

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = ["--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "4", "--intermediate", "688",
         "--vocab-size", "4096"]
RUNS = {  # title: (processes, sequence_parallel_size, mode)
    "one process, whole row": (1, 1, "auto"),
    "2 processes, ulysses": (2, 2, "ulysses"),
    "2 processes, allgather": (2, 2, "allgather"),
    "4 processes, ulysses": (4, 4, "ulysses"),
    "4 processes, allgather": (4, 4, "allgather"),
}
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2",
       "TOKENIZERS_PARALLELISM": "false"}


def shardtune(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtune", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **ENV, **(env or {})}, timeout=3600)


def run(model_dir: Path, out: Path, tokens: int, steps: int, processes: int, size: int, mode: str) -> dict:
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(processes)} if processes > 1 else {}
    done = shardtune("train", "examples/tiny/pt_full.yaml", f"model_name_or_path={model_dir}", f"output_dir={out}",
                     f"cutoff_len={tokens}", "per_device_train_batch_size=1", f"max_steps={steps}",
                     "logging_steps=1", "save_strategy=no", "plot_loss=false", "learning_rate=1e-4",
                     f"sequence_parallel_size={size}", f"sequence_parallel_mode={mode}", env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((out / "train_results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/shardtune-long-context"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    model_dir = args.out / "model"
    if not (model_dir / "config.json").is_file():
        done = shardtune("make-tiny-model", "--out", str(model_dir), *MODEL)
        assert done.returncode == 0, done.stderr[-2000:]
    rows = []
    for index, (title, (processes, size, mode)) in enumerate(RUNS.items()):
        started = time.perf_counter()
        results = run(model_dir, args.out / str(index), args.tokens, args.steps, processes, size, mode)
        peak = max(results["peak_memory_bytes_per_rank"])
        step = max(p - s for p, s in zip(results["peak_memory_bytes_per_rank"],
                                         results["peak_setup_memory_bytes_per_rank"], strict=True))
        rows.append((title, size, peak, step, results["estimated_memory_bytes"], time.perf_counter() - started,
                     results["train_runtime"]))
        print(f"{title}: peak {peak / 2**20:.0f} MiB per rank (step {step / 2**20:.0f} MiB), estimate "
              f"{results['estimated_memory_bytes'] / 2**20:.0f} MiB", flush=True)
    write_results(rows, args.tokens, args.steps)


def write_results(rows: list[tuple], tokens: int, steps: int) -> None:
    whole_peak, whole_step = rows[0][2], rows[0][3]
    lines = [f"# Long rows split over N CPU processes (sequence parallelism): peak memory per rank "
             f"({time.strftime('%Y-%m-%d')})", "",
             f"Random LLaMA (4 layers, hidden 256, 8 heads, 4 KV heads, vocabulary 4096), pt, full parameters, fp32 "
             f"AdamW, rows of {tokens} tokens, one row per step, {steps} steps; `benchmarks/long_context.py`.", "",
             machine_line(machine()), "",
             "| run | peak per rank (MiB) | step share per rank (MiB) | step share vs one process | estimated (MiB) | "
             "measured peak / estimated | wall (s) | train_runtime (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for title, _size, peak, step, estimate, wall, runtime in rows:
        lines.append(f"| {title} | {peak / 2**20:.0f} | {step / 2**20:.0f} | {step / whole_step:.2f} | "
                     f"{estimate / 2**20:.0f} | {peak / estimate:.2f} | {wall:.0f} | {runtime:.1f} |")
    lines += ["", f"One process on the whole row: peak {whole_peak / 2**20:.0f} MiB. The step share is the peak less "
                  "the set-up peak (model and optimizer built): the first step's activations, gradients and optimizer "
                  "states; the activations are the part that sequence parallelism divides. Wall times are of a "
                  "shared 2-core machine (4 processes on 2 cores) and say nothing about speed."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"long-context-{time.strftime('%Y-%m-%d')}-cpu.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
