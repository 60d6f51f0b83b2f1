"""A finished run's memory line (measured over estimated, per rank) for the two runs of issue 42.10, on 2 CPU ranks.

    .venv/bin/python benchmarks/zero3_lora_ratio_cpu.py [--work DIR] [--precision bf16|fp32|both]

* the tiny example under accelerate + ZeRO-3: ``accelerate launch --config_file examples/accelerate/deepspeed_z3.yaml
  -m shardtune.train examples/tiny/sft_lora.yaml`` (fp32, 40 steps, the example's saves);
* the ~206M-parameter ZeRO-3 LoRA run of ``make test-big`` (tests/distributed/test_big_model_memory.py: SHAPES["zero3"],
  Z3_BOUNDED, LORA_RUN: all linear layers, cutoff 128, micro-batch 1, 3 steps, final save), bf16 as shipped and fp32.

Each row is train_results.json's ``memory_measured_over_estimate`` and ``setup_memory_measured_over_estimate`` and
each rank's measured peak. Results go to benchmarks/results/zero3-lora-ratio-cpu.{json,md}.
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
from tests.distributed.test_big_model_memory import LORA_RUN, SHAPES, Z3_BOUNDED  # noqa: E402

MIB = 2**20
BIN = Path(sys.executable).parent


def run(argv: list[str], **env: str) -> None:
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                               "PYTHONPATH": str(REPO / "src"), **env})
    if done.returncode:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])


def row(name: str, out: Path) -> dict:
    found = json.loads((out / "train_results.json").read_text())
    return {"run": name, "ratio": found["memory_measured_over_estimate"],
            "setup_ratio": found.get("setup_memory_measured_over_estimate"),
            "peak_mib": [round(p / MIB, 1) for p in found["peak_memory_bytes_per_rank"]],
            "estimate_mib": round(found["estimated_memory_bytes"] / MIB, 1)}


def tiny_accelerate(work: Path) -> dict:
    out = work / "tiny-accelerate"
    run([str(BIN / "accelerate"), "launch", "--config_file", "examples/accelerate/deepspeed_z3.yaml", "-m",
         "shardtune.train", "examples/tiny/sft_lora.yaml", f"output_dir={out}"])
    return row("tiny example, accelerate + ZeRO-3 (fp32)", out)


def big_zero3(work: Path, bf16: bool, name: str = "", **env: str) -> dict:
    """The 206M run; ``env`` adds to its environment (e.g. an allocator setting), ``name`` to its output folder."""
    model = work / "big-zero3"
    if not (model / "model.safetensors").exists():
        run([sys.executable, "-m", "shardtune", "make-tiny-model", "--out", str(model), *SHAPES["zero3"]])
    z3 = work / "z3_bounded.json"
    z3.write_text(json.dumps(Z3_BOUNDED))
    out = work / f"big-{'bf16' if bf16 else 'fp32'}{name}"
    run([sys.executable, "-m", "shardtune", "train",
         *overrides_merged([*LORA_RUN, f"model_name_or_path={model}", f"output_dir={out}", f"deepspeed={z3}",
                            f"bf16={str(bf16).lower()}"])], FORCE_TORCHRUN="1", NPROC_PER_NODE="2", **env)
    found = row(f"206M LoRA, ZeRO-3 bounded ({'bf16' if bf16 else 'fp32'})", out)
    return {**found, "loop_seconds": json.loads((out / "train_results.json").read_text())["train_runtime"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=["bf16", "fp32", "both"], default="both")
    parser.add_argument("--work", type=Path, default=None, help="keep the built model here between runs")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="zero3-lora-ratio-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = [tiny_accelerate(work)]
    for bf16 in {"bf16": [True], "fp32": [False], "both": [True, False]}[args.precision]:
        rows.append(big_zero3(work, bf16))
        print(json.dumps(rows[-1]), flush=True)
    info = machine()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "zero3-lora-ratio-cpu.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")
    lines = ["# ZeRO-3 LoRA: measured peak per rank over the estimate (2 CPU ranks)", "",
             f"`benchmarks/zero3_lora_ratio_cpu.py`, {time.strftime('%Y-%m-%d %H:%M')}.", "", machine_line(info), "",
             "| run | measured per rank | estimate | ratio | set-up ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {' / '.join(f'{p} MiB' for p in r['peak_mib'])} | {r['estimate_mib']} MiB | "
              f"{r['ratio']} | {r['setup_ratio']} |" for r in rows]
    (RESULTS / "zero3-lora-ratio-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
