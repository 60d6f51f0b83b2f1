"""Peak memory per rank of full-parameter DPO on 2 CPU processes, where the reference model lives, against the
estimate, per engine.

    .venv/bin/python benchmarks/preference_memory.py                 # results to benchmarks/results
    .venv/bin/python benchmarks/preference_memory.py --out /tmp/pm --steps 2

A random LLaMA (8 layers, hidden 512: about 27M parameters, 102 MiB in fp32) trains full-parameter DPO on the
bundled pairs for a few steps through `FORCE_TORCHRUN=1 NPROC_PER_NODE=2 shardtune train`, one run at a time,
under DDP, ZeRO-3 and FSDP2 FULL_SHARD, each with the live reference (a frozen copy placed as the policy: a
replica under DDP, sharded under ZeRO-3 and FSDP2) and with ``precompute_ref_log_probs: true`` (none in memory).

The measured number is shardtune's own ``peak_memory_bytes_per_rank`` of train_results.json (resident memory the
rank gained from before the model was loaded to the end of training; see train/workflow.py ``MemoryProbe``); the
estimate is ``estimated_memory_bytes`` of the same file: the memory model of `shardtune estimate` for that run
(reference and the two rows of each pair included: estimate/parts.py ``reference_share``, estimate/config.py
``workload_from_config``), as max(tensors of a step, set-up) + the CPU runtime (estimate/compare.py).

``--stage rm`` measures reward models instead (no reference; the score row instead of the output matrix; one score
per token instead of the vocabulary logits): full under DDP, ZeRO-3 and FSDP2, freeze and LoRA under DDP.
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
MODEL = ["--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "4", "--intermediate", "1376",
         "--vocab-size", "4096"]
DPO_RUNS = {
    "DDP, live reference (replica)": [],
    "DDP, precomputed reference": ["precompute_ref_log_probs=true"],
    "ZeRO-3, live reference (sharded)": ["deepspeed=z3"],
    "ZeRO-3, precomputed reference": ["precompute_ref_log_probs=true", "deepspeed=z3"],
    "FSDP2 FULL_SHARD, live reference (sharded)": ["fsdp=full_shard auto_wrap"],
    "FSDP2 FULL_SHARD, precomputed reference": ["precompute_ref_log_probs=true", "fsdp=full_shard auto_wrap"],
}
RM_RUNS = {
    "DDP, full": [],
    "ZeRO-3, full": ["deepspeed=z3"],
    "FSDP2 FULL_SHARD, full": ["fsdp=full_shard auto_wrap"],
    "DDP, freeze (last 2 layers)": ["finetuning_type=freeze", "freeze_trainable_layers=2"],
    "DDP, LoRA r=8 (all)": ["finetuning_type=lora"],
}
# The estimate assumes the longest batch is cutoff_len tokens long: with 32 (the bundled prompts take up to 25
# tokens with the template, prompt + shorter answer 21 and more) most rows are cut to 32, so the batches that run
# are (nearly) that long, rather than a few dozen tokens under a cutoff_len of 256.
CUTOFF = 32
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2",
       "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2", "TOKENIZERS_PARALLELISM": "false"}


def shardtune(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtune", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=1800)


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(_numel(f.get_slice(name).get_shape()) for name in f.keys())


def _numel(shape: list[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/shardtune-preference-memory"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stage", choices=("dpo", "rm"), default="dpo")
    args = parser.parse_args()
    model_dir = args.out / "model"
    if not (model_dir / "config.json").is_file():
        done = shardtune("make-tiny-model", "--out", str(model_dir), *MODEL)
        assert done.returncode == 0, done.stderr[-2000:]
    params = parameter_count(model_dir)
    rows = []
    for index, (title, extra) in enumerate((RM_RUNS if args.stage == "rm" else DPO_RUNS).items()):
        out = args.out / args.stage / str(index)
        started = time.perf_counter()
        done = shardtune("train", "examples/tiny/dpo_lora.yaml", f"model_name_or_path={model_dir}",
                         f"output_dir={out}", f"stage={args.stage}", "finetuning_type=full",
                         f"max_steps={args.steps}", "logging_steps=1", "save_strategy=no", "plot_loss=false",
                         "per_device_train_batch_size=2", f"cutoff_len={CUTOFF}", "learning_rate=1e-5", *extra,
                         env=ENV)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        results = json.loads((out / "train_results.json").read_text())
        peak, estimate = max(results["peak_memory_bytes_per_rank"]), results["estimated_memory_bytes"]
        rows.append((title, peak, estimate, time.perf_counter() - started))
        print(f"{title}: {peak / 2**20:.0f} MiB per rank measured, {estimate / 2**20:.0f} MiB estimated", flush=True)
    write_results(rows, params, args.steps, args.stage)


def write_results(rows: list[tuple[str, int, int, float]], params: int, steps: int, stage: str) -> None:
    ddp = rows[0][1]
    what = "Reward models" if stage == "rm" else "Full-parameter DPO"
    lines = [f"# {what}: peak memory per rank against the estimate, 2 CPU processes "
             f"({time.strftime('%Y-%m-%d')})", "",
             f"Random LLaMA, {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB in fp32), fp32 AdamW, "
             f"{steps} steps of 2 pairs per rank (4 rows of at most {CUTOFF} tokens per forward, cutoff_len {CUTOFF}), "
             "`benchmarks/preference_memory.py`.", "",
             machine_line(machine()), "",
             f"| run | measured peak per rank (MiB) | estimated (MiB) | measured / estimated | vs {rows[0][0]} | "
             "wall (s) |",
             "|---|---|---|---|---|---|"]
    for title, peak, estimate, wall in rows:
        lines.append(f"| {title} | {peak / 2**20:.0f} | {estimate / 2**20:.0f} | {peak / estimate:.2f} | "
                     f"{peak / ddp:.2f} | {wall:.0f} |")
    if stage == "dpo":
        lines += ["", f"The live reference's predicted share: {params * 4 / 2**20:.0f} MiB per rank as a replica "
                      f"(DDP), {params * 2 / 2**20:.0f} MiB per rank sharded over 2 (ZeRO-3, FSDP2)."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "reward" if stage == "rm" else "preference"
    path = RESULTS / f"{name}-memory-estimate-{time.strftime('%Y-%m-%d')}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
