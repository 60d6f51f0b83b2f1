"""shardtune beside LLaMA-Factory on CPU: one LoRA SFT file, 2 processes, the same data, model, batch and steps.

    .venv/bin/python benchmarks/llamafactory_cpu.py                      # needs LLaMA-Factory in /work/lf-venv
    .venv/bin/python benchmarks/llamafactory_cpu.py --repeats 3 --lf-python /path/to/venv/bin/python

LLaMA-Factory lives in its own virtual environment (its pins differ from ours: transformers <= 5.6, peft 0.18,
datasets <= 4.0); the script only needs its interpreter (``--lf-python``). One YAML file in LLaMA-Factory's own
keys is trained by both commands, so every setting is the same by construction:

* ``FORCE_TORCHRUN=1 NPROC_PER_NODE=2 llamafactory-cli train run.yaml``
* ``FORCE_TORCHRUN=1 NPROC_PER_NODE=2 shardtune train run.yaml``

The file is ``examples/tiny/sft_lora.yaml``'s run in LLaMA-Factory's keys: a random tiny LLaMA (built once with
``shardtune make-tiny-model``; ``--layers/--hidden`` change it), LoRA rank 16 on all linear layers, the bundled
demo data (alpaca + sharegpt, chatml template, cutoff 256), micro-batch 4 x accumulation 2, 40 steps, a final
adapter save, no checkpoints, no evaluation, activation checkpointing off for both (LLaMA-Factory turns it on
by default; shardtune off). Both sides run with ``OMP_NUM_THREADS=1`` per rank.

Two numbers per run: the **whole command's wall time** (from starting the command to its exit: imports, data,
model, the loop, the final save) and the **training loop's time** (each tool's own ``train_runtime`` in
``train_results.json``: from the loop's start to its end, before the final save, for both). Runs are interleaved
(shardtune, LLaMA-Factory, shardtune, ...) so that the load of this shared machine hits both alike; the table
gives each pair's ratio and the medians. Results go to ``benchmarks/results/llamafactory-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import machine, machine_line

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SHARDTUNE = [sys.executable, "-m", "shardtune.cli"]
LF_PYTHON = Path("/work/lf-venv/bin/python")

RUN_KEYS = {
    "stage": "sft", "do_train": True, "finetuning_type": "lora", "lora_rank": 16, "lora_target": "all",
    "dataset": "demo,demo_sharegpt", "template": "chatml", "cutoff_len": 256, "overwrite_cache": True,
    "overwrite_output_dir": True, "logging_steps": 5, "save_strategy": "no", "plot_loss": False, "report_to": "none",
    "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": 5.0e-3, "max_steps": 40,
    "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "seed": 42, "disable_gradient_checkpointing": True,
    "val_size": 0, "ddp_timeout": 600,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lf-python", type=Path, default=LF_PYTHON, help="LLaMA-Factory's interpreter")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (interleaved)")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardtune-bench-llamafactory"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="llamafactory-cpu")
    parser.add_argument("--only", choices=["shardtune", "llamafactory"], help="run one side (profiling)")
    parser.add_argument("--shardtune-args", default="", help="extra key=value overrides for shardtune only "
                        "(profiling a setting; the recorded comparison uses none)")
    return parser.parse_args(argv)


def prepare(work: Path, layers: int, hidden: int, steps: int) -> Path:
    """The model, the data folder and the YAML both tools train; returns the YAML's path."""
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"llama-{layers}x{hidden}"
    if not (model / "config.json").is_file():
        heads = max(hidden // 16, 1)
        subprocess.run([*SHARDTUNE, "make-tiny-model", "--out", str(model), "--layers", str(layers), "--hidden",
                        str(hidden), "--heads", str(heads), "--kv-heads", str(max(heads // 2, 1)),
                        "--intermediate", str(hidden * 8 // 3), "--overwrite"], check=True, cwd=REPO,
                       capture_output=True)
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(REPO / "data", data)
    config = {"model_name_or_path": str(model), "dataset_dir": str(data), **RUN_KEYS, "max_steps": steps}
    path = work / "run.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))
    return path


def command(tool: str, config: Path, out: Path, lf_python: Path, extra: str = "") -> list[str]:
    if tool == "shardtune":
        return [*SHARDTUNE, "train", str(config), f"output_dir={out}", *extra.split()]
    return [str(lf_python), "-m", "llamafactory.cli", "train", str(config), f"output_dir={out}"]


def run_once(tool: str, config: Path, work: Path, procs: int, lf_python: Path, extra: str = "") -> dict:
    out = work / "runs" / tool
    shutil.rmtree(out, ignore_errors=True)
    argv = command(tool, config, out, lf_python, extra)
    env = {**os.environ, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(procs), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "DISABLE_VERSION_CHECK": "1", "TOKENIZERS_PARALLELISM": "false"}
    if tool == "llamafactory":
        env.pop("PYTHONPATH", None)  # its own venv: none of shardtune's sources or packages
        env["PATH"] = f"{lf_python.parent}{os.pathsep}{env.get('PATH', '')}"  # it starts `torchrun` from PATH
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"{tool} failed ({done.returncode}): {shlex.join(argv)}")
    results = json.loads((out / "train_results.json").read_text())
    return {"tool": tool, "wall_seconds": round(wall, 3), "loop_seconds": results["train_runtime"],
            "cpu_seconds": round(cpu, 3),
            "train_loss": results.get("train_loss"), "steps": results.get("global_step", config_steps(config)),
            "command": f"FORCE_TORCHRUN=1 NPROC_PER_NODE={procs} " + shlex.join(argv)}


def config_steps(config: Path) -> int:
    for line in config.read_text().splitlines():
        if line.startswith("max_steps:"):
            return int(line.split(":")[1])
    return -1


def summarise(pairs: list[dict[str, dict]]) -> dict:
    """Per-pair ratios (LLaMA-Factory's time over shardtune's: > 1 means shardtune is faster) and medians."""
    keys = ("wall_seconds", "loop_seconds", "cpu_seconds")
    ratios = {key: [round(p["llamafactory"][key] / p["shardtune"][key], 3) for p in pairs] for key in keys}
    medians = {tool: {key: statistics.median(p[tool][key] for p in pairs) for key in keys}
               for tool in ("shardtune", "llamafactory")}
    found: dict = {f"{key.split('_')[0]}_speedup_each_pair": ratios[key] for key in keys}
    for key in keys:
        found[f"{key.split('_')[0]}_speedup_of_medians"] = round(
            medians["llamafactory"][key] / medians["shardtune"][key], 3)
        found[f"{key.split('_')[0]}_speedup_median_of_pairs"] = round(statistics.median(ratios[key]), 3)
    found["medians"] = medians
    return found


def render(pairs: list[dict[str, dict]], summary: dict, info: dict, argv_line: str, lf_version: str) -> str:
    lines = [f"Command: `{argv_line}`", "", machine_line(info) + f" LLaMA-Factory {lf_version} (its own venv).", "",
             f"Both: `{pairs[0]['shardtune']['command']}` and `{pairs[0]['llamafactory']['command']}` (cwd: the work "
             "folder holding run.yaml).", "",
             "| pair | wall: shardtune / LLaMA-Factory | speed-up | loop: shardtune / LLaMA-Factory | speed-up "
             "| CPU time: shardtune / LLaMA-Factory | ratio | train_loss |", "|---:|---|---:|---|---:|---|---:|---|"]
    for i, p in enumerate(pairs):
        st, lf = p["shardtune"], p["llamafactory"]
        lines.append(f"| {i + 1} | {st['wall_seconds']:.1f} s / {lf['wall_seconds']:.1f} s | "
                     f"{summary['wall_speedup_each_pair'][i]:.2f}x | {st['loop_seconds']:.1f} s / "
                     f"{lf['loop_seconds']:.1f} s | {summary['loop_speedup_each_pair'][i]:.2f}x | "
                     f"{st['cpu_seconds']:.1f} s / {lf['cpu_seconds']:.1f} s | "
                     f"{summary['cpu_speedup_each_pair'][i]:.2f}x | {st['train_loss']:.4f} / {lf['train_loss']:.4f} |")
    m = summary["medians"]
    lines += ["", f"Medians: shardtune {m['shardtune']['wall_seconds']:.1f} s wall, "
              f"{m['shardtune']['loop_seconds']:.1f} s loop; LLaMA-Factory {m['llamafactory']['wall_seconds']:.1f} s "
              f"wall, {m['llamafactory']['loop_seconds']:.1f} s loop: shardtune "
              f"**{summary['wall_speedup_of_medians']:.2f}x** faster in wall time and "
              f"**{summary['loop_speedup_of_medians']:.2f}x** in the training loop (medians of the pairs' own ratios: "
              f"{summary['wall_speedup_median_of_pairs']:.2f}x and {summary['loop_speedup_median_of_pairs']:.2f}x); "
              f"{summary['cpu_speedup_of_medians']:.2f}x less CPU time for the whole command."]
    return "\n".join(lines) + "\n"


def lf_version(lf_python: Path) -> str:
    done = subprocess.run([str(lf_python), "-c", "import importlib.metadata as m; print(m.version('llamafactory'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config = prepare(args.work_dir, args.layers, args.hidden, args.steps)
    tools = [args.only] if args.only else ["shardtune", "llamafactory"]
    pairs: list[dict[str, dict]] = []
    for repeat in range(args.repeats):
        pair = {}
        for tool in tools:
            pair[tool] = run_once(tool, config, args.work_dir, args.procs, args.lf_python, args.shardtune_args)
            print(f"[{repeat + 1}/{args.repeats}] {tool}: wall {pair[tool]['wall_seconds']:.1f} s, loop "
                  f"{pair[tool]['loop_seconds']:.1f} s, CPU {pair[tool]['cpu_seconds']:.1f} s, train_loss "
                  f"{pair[tool]['train_loss']}", flush=True)
        pairs.append(pair)
    if args.only:
        return 0
    summary = summarise(pairs)
    info = machine()
    argv_line = shlex.join(["python", "benchmarks/llamafactory_cpu.py", *argv])
    text = render(pairs, summary, info, argv_line, lf_version(args.lf_python))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": argv_line, "machine": info, "config": RUN_KEYS, "summary": summary, "pairs": pairs}
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
