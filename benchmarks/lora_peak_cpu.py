"""A LoRA run's peak memory per rank under FSDP2 and ZeRO-3, with the shipped LoRA example's settings.

    .venv/bin/python benchmarks/lora_peak_cpu.py                      # both engines, checkpointing on and off
    .venv/bin/python benchmarks/lora_peak_cpu.py --engines fsdp2 --checkpointing on

What `make test-big` asserts (tests/distributed/test_big_model_memory.py), measured the same way: each rank's peak
resident memory (train_results.json, VmHWM) of a 2-process CPU run on a ~206M-parameter model (fp32 weights
~786 MiB) minus the same run on the tiny model (the runtime's own overhead), in multiples of the model's bytes.
The run is the test's (``LORA_RUN``: ``examples/tiny/sft_lora.yaml``, LoRA on all linear layers, at cutoff 128,
micro-batch 1, 3 steps, with the final adapter save), with bf16 and gradient checkpointing each on and off; the model
shapes are the test's (FSDP2: 46 thin layers; ZeRO-3: 18 wider ones) and ZeRO-3 is bounded as there. Results go to
benchmarks/results/lora-peak-cpu.{json,md}.
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

ENGINES = {"fsdp2": ("fsdp=full_shard auto_wrap",), "zero3": ("deepspeed={z3}",)}
MIB = 2**20


def shardtune(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2", "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "shardtune", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)


def build(work: Path, name: str, *shape: str) -> Path:
    out = work / name
    if not (out / "model.safetensors").exists():
        done = shardtune("make-tiny-model", "--out", str(out), *shape)
        if done.returncode:
            raise SystemExit(done.stderr[-2000:])
    return out


def train(model: Path, out: Path, checkpointing: bool, bf16: bool, engine: tuple[str, ...]) -> dict:
    done = shardtune("train", *overrides_merged([*LORA_RUN, f"model_name_or_path={model}", f"output_dir={out}",
                                                 f"gradient_checkpointing={str(checkpointing).lower()}",
                                                 f"bf16={str(bf16).lower()}", *engine]))
    if done.returncode:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])
    return json.loads((out / "train_results.json").read_text())


def measure(work: Path, engine: str, checkpointing: bool, bf16: bool, tiny: Path) -> dict:
    model = build(work, f"big-{engine}", *SHAPES[engine])
    weights = (model / "model.safetensors").stat().st_size
    z3 = work / "z3_bounded.json"
    z3.write_text(json.dumps(Z3_BOUNDED))
    settings = tuple(arg.format(z3=z3) for arg in ENGINES[engine])
    tag = f"{engine}-{'ckpt' if checkpointing else 'nockpt'}-{'bf16' if bf16 else 'fp32'}"
    base = train(tiny, work / f"{tag}-tiny", checkpointing, bf16, settings)
    big = train(model, work / f"{tag}-big", checkpointing, bf16, settings)
    row = {"engine": engine, "gradient_checkpointing": checkpointing, "bf16": bf16, "weights_bytes": weights}
    for key, name in (("peak_process_memory_bytes_per_rank", "peak"),
                      ("peak_setup_process_memory_bytes_per_rank", "setup")):
        row[name] = [round((b - o) / weights, 3) for b, o in zip(big[key], base[key], strict=True)]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="fsdp2,zero3")
    parser.add_argument("--checkpointing", choices=["on", "off", "both"], default="both")
    parser.add_argument("--precision", choices=["bf16", "fp32", "both"], default="both",
                        help="bf16: true (the shipped LoRA example's) or fp32 weights and compute")
    parser.add_argument("--work", type=Path, default=None, help="keep the built models here between runs")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="lora-peak-"))
    work.mkdir(parents=True, exist_ok=True)
    tiny = build(work, "tiny")
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.checkpointing]
    precisions = {"bf16": [True], "fp32": [False], "both": [True, False]}[args.precision]
    rows = []
    for engine in args.engines.split(","):
        for bf16 in precisions:
            for checkpointing in modes:
                started = time.time()
                row = measure(work, engine, checkpointing, bf16, tiny)
                rows.append(row | {"seconds": round(time.time() - started)})
                print(json.dumps(rows[-1]), flush=True)
    info = machine()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora-peak-cpu.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")
    lines = ["# LoRA peak per rank above the tiny run, in multiples of the model's bytes", "",
             f"`benchmarks/lora_peak_cpu.py`, {time.strftime('%Y-%m-%d %H:%M')}: 2 CPU ranks, "
             "examples/tiny/sft_lora.yaml (all linear layers) at cutoff 128, micro-batch 1, 3 steps, final save.",
             "", machine_line(info), "",
             "| engine | precision | gradient_checkpointing | model | whole run, rank 0 / rank 1 | set-up only |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['engine']} | {'bf16' if row['bf16'] else 'fp32'} | "
                     f"{'on' if row['gradient_checkpointing'] else 'off'} | "
                     f"{row['weights_bytes'] / MIB:.0f} MiB | {row['peak'][0]:.2f}x / {row['peak'][1]:.2f}x | "
                     f"{row['setup'][0]:.2f}x / {row['setup'][1]:.2f}x |")
    (RESULTS / "lora-peak-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
