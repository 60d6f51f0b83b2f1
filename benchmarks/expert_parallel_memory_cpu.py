"""Expert parallelism's memory line: each run's measured peak per rank over the estimate it prints, on CPU ranks.

    .venv/bin/python benchmarks/expert_parallel_memory_cpu.py [--work DIR] [--cells tiny-2-ep2,moe26m-2-ep2,...]

Two Qwen3-MoE models: the tiny family model (`arch_model_dir("qwen3_moe")`: 4 experts of width 32, 0.34M parameters,
17 MiB of tensors, so the CPU runtime term decides its ratio) and the 26M-parameter one of
tests/distributed/test_expert_parallel_memory.py (MEMORY_MOE: 8 experts of width 1024 in 4 layers, 95% of the
weights are experts). Each cell is `shardtune train` with that test's MEMORY_RUN (full fine-tuning, FSDP2
FULL_SHARD, micro-batch 2, accumulation 2, 4 steps, final save) on N processes with expert_parallel_size E; the row
is train_results.json's ``memory_measured_over_estimate`` (the run-end line's ratio), the set-up ratio, each rank's
peak and the estimate's parts. Results go to benchmarks/results/expert-parallel-memory-cpu.{json,md} (a run of some
cells keeps the recorded rows of the others).
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
sys.path.insert(0, str(REPO))

from tests.conftest import overrides_merged  # noqa: E402
from tests.distributed.test_expert_parallel_memory import MEMORY_RUN, build_memory_moe  # noqa: E402

MIB = 2**20
# Rows of cutoff_len tokens (the length the estimate assumes), 4 per micro-batch: activations and dispatch weigh
# more. transformers' aux loss takes no packed rows' block mask, so it is off here.
PACKED_MB4 = ("packing=true", "moe_aux_loss_coef=0", "per_device_train_batch_size=4")
# name -> (model, processes, expert_parallel_size, extra keys)
CELLS = {
    "tiny-2-ep1": ("tiny", 2, 1, ()),
    "tiny-2-ep2": ("tiny", 2, 2, ()),
    "moe26m-2-ep1": ("moe26m", 2, 1, ()),
    "moe26m-2-ep2": ("moe26m", 2, 2, ()),
    "moe26m-2-ep1-packed-mb4": ("moe26m", 2, 1, PACKED_MB4),
    "moe26m-2-ep2-packed-mb4": ("moe26m", 2, 2, PACKED_MB4),
    "moe26m-4-ep2": ("moe26m", 4, 2, ()),
    "moe26m-4-ep4": ("moe26m", 4, 4, ()),
}


def build_models(work: Path) -> dict[str, Path]:
    from shardtune.model.tiny import build_tiny_model

    tiny, wide = work / "tiny-qwen3_moe", work / "moe26m"
    if not (tiny / "model.safetensors").exists():
        build_tiny_model(tiny, arch="qwen3_moe")
    if not (wide / "model.safetensors").exists():
        build_memory_moe(wide)
    return {"tiny": tiny, "moe26m": wide}


def run_cell(name: str, model: Path, out: Path) -> dict:
    _, nproc, ep, extra = CELLS[name]
    argv = [sys.executable, "-m", "shardtune", "train",
            *overrides_merged([*MEMORY_RUN, f"model_name_or_path={model}", f"output_dir={out}",
                               f"expert_parallel_size={ep}", *extra])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO / "src"),
           "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(nproc)}
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])
    found = json.loads((out / "train_results.json").read_text())
    parts = found["estimated_memory_parts_bytes"]
    return {"cell": name, "processes": nproc, "expert_parallel_size": ep, "extra": list(extra),
            "experts_per_rank": (found.get("expert_parallel") or {}).get("experts_per_rank"),
            "ratio": found["memory_measured_over_estimate"],
            "setup_ratio": found.get("setup_memory_measured_over_estimate"),
            "peak_mib": [round(p / MIB, 1) for p in found["peak_memory_bytes_per_rank"]],
            "estimate_mib": round(found["estimated_memory_bytes"] / MIB, 1),
            "parts_mib": {k: round(v / MIB, 1) for k, v in parts.items()}}


def merged_rows(rows: list[dict]) -> list[dict]:
    """This run's rows and the recorded rows of the cells it did not run, in CELLS' order."""
    recorded = RESULTS / "expert-parallel-memory-cpu.json"
    kept = json.loads(recorded.read_text())["rows"] if recorded.is_file() else []
    by_cell = {r["cell"]: r for r in kept if r["cell"] in CELLS} | {r["cell"]: r for r in rows}
    return [by_cell[name] for name in CELLS if name in by_cell]


def write_results(rows: list[dict]) -> str:
    info = machine()
    RESULTS.mkdir(exist_ok=True)
    rows = merged_rows(rows)
    (RESULTS / "expert-parallel-memory-cpu.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1)
                                                             + "\n")
    lines = ["# Expert parallelism: measured peak per rank over the estimate (CPU ranks, FSDP2 FULL_SHARD)", "",
             f"`benchmarks/expert_parallel_memory_cpu.py`, {time.strftime('%Y-%m-%d %H:%M')}.", "",
             machine_line(info), "",
             "| cell | processes | EP | experts per rank | measured per rank | estimate (tensors / set-up / runtime) "
             "| ratio | set-up ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["parts_mib"]
        lines.append(f"| {r['cell']} | {r['processes']} | {r['expert_parallel_size']} | {r['experts_per_rank'] or '-'} "
                     f"| {' / '.join(f'{x} MiB' for x in r['peak_mib'])} | {r['estimate_mib']} MiB ({p['training']} "
                     f"/ {p['setup']} / {p['runtime']}) | {r['ratio']} | {r['setup_ratio']} |")
    text = "\n".join(lines) + "\n"
    (RESULTS / "expert-parallel-memory-cpu.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=None, help="keep the built models here between runs")
    parser.add_argument("--cells", default=",".join(CELLS), help="comma-separated cells (default: all)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ep-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    models = build_models(work)
    rows = []
    for name in args.cells.split(","):
        rows.append(run_cell(name, models[CELLS[name][0]], work / "runs" / name))
        print(json.dumps(rows[-1]), flush=True)
    print(write_results(rows))


if __name__ == "__main__":
    main()
