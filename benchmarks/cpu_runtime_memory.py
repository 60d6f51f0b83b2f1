"""The CPU runtime term of the memory estimate, per engine and precision: what a rank's measured peak holds beyond
the estimate of its tensors, on the tiny model (its tensors are a few MiB, so nearly all of it is runtime).

    .venv/bin/python benchmarks/cpu_runtime_memory.py [--steps 8] [--engines local,ddp,fsdp,z3] [--precisions fp32,bf16]

Each cell trains ``examples/tiny/sft_{full,lora}.yaml`` for --steps steps (one process for ``local``, else 2
ranks under shardtune's torchrun), and reads train_results.json: the busiest rank's measured peak minus the larger
of the estimate's tensors of a step and of the set-up (``estimated_memory_parts_bytes``), against the estimate's
own runtime (estimate/compare.py: CPU_RUN_RUNTIME_BYTES, plus CPU_HALF_PRECISION_KERNEL_BYTES in bf16). Results go to
benchmarks/results/cpu-runtime-memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, machine_line

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MIB = 2**20
ENGINE_ARGS = {"local": [], "ddp": [], "fsdp": ["fsdp=full_shard auto_wrap"], "z3": ["deepspeed=z3"]}


def cell(work: Path, engine: str, finetuning: str, precision: str, steps: int) -> dict:
    out = work / f"{engine}-{finetuning}-{precision}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO / "src")}
    if engine != "local":
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    argv = [sys.executable, "-m", "shardtune", "train", f"examples/tiny/sft_{finetuning}.yaml", f"max_steps={steps}",
            "logging_steps=1", "save_strategy=no", "plot_loss=false", f"output_dir={out}",
            f"bf16={'true' if precision == 'bf16' else 'false'}", *ENGINE_ARGS[engine]]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])
    found = json.loads((out / "train_results.json").read_text())
    parts = found["estimated_memory_parts_bytes"]
    peak = max(found["peak_memory_bytes_per_rank"])
    return {"engine": engine, "finetuning": finetuning, "precision": precision, "steps": steps,
            "peak_mib": round(peak / MIB, 1), "tensors_mib": round(max(parts["training"], parts["setup"]) / MIB, 1),
            "runtime_measured_mib": round((peak - max(parts["training"], parts["setup"])) / MIB, 1),
            "runtime_estimated_mib": round((parts["runtime"] + parts.get("kernels", 0)) / MIB, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--engines", default="local,ddp,fsdp,z3")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cpu-runtime-memory-"))
    rows = [cell(work, engine, finetuning, precision, args.steps)
            for engine in args.engines.split(",") for finetuning in ("full", "lora")
            for precision in args.precisions.split(",")]
    info = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu-runtime-memory.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    lines = ["# The CPU runtime term: measured peak minus estimated tensors, tiny model", "",
             f"`benchmarks/cpu_runtime_memory.py --steps {args.steps}`, {time.strftime('%Y-%m-%d %H:%M')}.", "",
             machine_line(info), "",
             "| engine | fine-tuning | precision | measured peak | estimated tensors | runtime measured | "
             "runtime estimated |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['finetuning']} | {r['precision']} | {r['peak_mib']} MiB | {r['tensors_mib']} MiB "
              f"| {r['runtime_measured_mib']} MiB | {r['runtime_estimated_mib']} MiB |" for r in rows]
    (args.out / "cpu-runtime-memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
