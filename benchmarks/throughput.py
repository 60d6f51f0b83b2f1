"""Throughput: effective tokens per second, padding, start-up time and memory of real `shardtune train` runs.

    .venv/bin/python benchmarks/throughput.py                         # everything, results to benchmarks/results
    .venv/bin/python benchmarks/throughput.py --suites packing --repeats 3
    .venv/bin/python benchmarks/throughput.py --suites engines --engines ddp,fsdp --procs 2 --out /tmp/tp

Every run is the real command line (`shardtune train CONFIG key=value ...`, NPROC_PER_NODE and FORCE_TORCHRUN in
its environment), one at a time; the numbers come from the run's own `train_results.json` ("throughput"), where
the training loop records, per optimizer step, its wall time (data loading included) and the non-padding tokens
and token slots it trained, summed over ranks. Time to first step is measured from the moment this script starts
the command to the end of the first optimizer step.

Two suites:

* ``packing``: one process, one epoch of the SFT demo data, the same model, samples and micro-batch size, as
  plain padded batches, padded batches grouped by length, and packed rows. The learning rate is 1e-9 so that the
  model does not change during the epoch: every variant then computes the loss of the same model on the same
  trainable tokens, and its loss per token must agree with the padded run's; a mismatch would mean packing lets
  samples see each other or drops tokens. Packed rows hold several samples, so "tokens per second" compares what
  matters - trainable work per second - rather than steps.
* ``engines``: packed rows, a fixed number of steps after warm-up, for 1 and 2 processes and DDP (a single
  process runs the local engine), ZeRO-2, ZeRO-3 and FSDP FULL_SHARD.

Beside them, ``startup`` times the commands a user waits on before any training: ``shardtune --help`` and
``shardtune check CONFIG`` (median of 5 wall times each).

Repeats are interleaved (A B C A B C) so that a change in machine load hits every variant alike; a row reports
the median over repeats.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import machine, machine_line

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIG = "examples/tiny/sft_full.yaml"
SHARDTUNE = [sys.executable, "-m", "shardtune.cli"]
QUIET = ["save_strategy=no", "do_eval=false", "eval_strategy=no", "val_size=0", "plot_loss=false",
         "logging_steps=100000", "overwrite_output_dir=true", "report_to=none"]
ENGINE_OVERRIDES = {
    "ddp": [],
    "zero2": ["deepspeed=examples/deepspeed/ds_z2_config.json"],
    "zero3": ["deepspeed=examples/deepspeed/ds_z3_config.json"],
    "fsdp": ["fsdp=full_shard auto_wrap"],
}
ENGINE_LABELS = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP FULL_SHARD"}
PACKING_VARIANTS = {
    "padded": ["packing=false"],
    "padded, grouped by length": ["packing=false", "group_by_length=true"],
    "packed": ["packing=true"],
}


@dataclass(frozen=True)
class RunSpec:
    suite: str
    label: str
    procs: int
    overrides: tuple[str, ...] = ()


def packing_specs() -> list[RunSpec]:
    epoch = ["num_train_epochs=1", "max_steps=-1", "learning_rate=1e-9"]
    return [RunSpec("packing", label, 1, (*epoch, *extra)) for label, extra in PACKING_VARIANTS.items()]


def engine_specs(engines: list[str], procs: list[int], steps: int, warmup: int) -> list[RunSpec]:
    fixed = [f"max_steps={steps + warmup}", f"throughput_warmup_steps={warmup}", "packing=true"]
    specs = []
    for n in procs:
        for engine in engines:
            label = "local" if engine == "ddp" and n == 1 else ENGINE_LABELS[engine]
            specs.append(RunSpec("engines", label, n, (*fixed, *ENGINE_OVERRIDES[engine])))
    return specs


def command_for(spec: RunSpec, config: str, out_dir: Path) -> tuple[list[str], dict[str, str]]:
    argv = [*SHARDTUNE, "train", config, f"output_dir={out_dir}", *QUIET, *spec.overrides]
    env = {**os.environ, "NPROC_PER_NODE": str(spec.procs), "OMP_NUM_THREADS": "1"}
    if spec.procs == 1 and spec.label != "local" and spec.suite == "engines":
        env["FORCE_TORCHRUN"] = "1"  # a real ZeRO / FSDP engine even for one process
    return argv, env


def run_once(spec: RunSpec, config: str, scratch: Path) -> dict:
    out_dir = scratch / f"{spec.suite}-{spec.label.replace(' ', '_').replace(',', '')}-{spec.procs}"
    argv, env = command_for(spec, config, out_dir)
    started = time.time()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"run failed ({done.returncode}): {shlex.join(argv)}")
    results = json.loads((out_dir / "train_results.json").read_text())
    tp = results["throughput"]
    return {
        "suite": spec.suite, "variant": spec.label, "processes": spec.procs, "engine": results["engine"],
        "steps": results["global_step"], "effective_tokens_per_second": tp["effective_tokens_per_second"],
        "padding_fraction": tp["padding_fraction"], "step_time_median_seconds": tp["step_time_median_seconds"],
        "first_step_seconds": round(tp["first_step_unix_time"] - started, 2),
        "loss_per_token": tp["loss_per_token"],
        "peak_memory_mib_per_rank": [round(b / 2**20, 1) for b in results["peak_process_memory_bytes_per_rank"]],
        "wall_seconds": round(time.time() - started, 2),
        "command": f"NPROC_PER_NODE={env['NPROC_PER_NODE']} "
                   + (f"FORCE_TORCHRUN={env['FORCE_TORCHRUN']} " if "FORCE_TORCHRUN" in env else "")
                   + shlex.join(["shardtune", *argv[len(SHARDTUNE):]]),
    }


def startup_times(config: str, samples: int = 5) -> dict[str, float]:
    """Median wall seconds of `shardtune --help` and `shardtune check CONFIG` (fresh interpreter each)."""
    found = {}
    for name, args in {"help": ["--help"], "check": ["check", config]}.items():
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            subprocess.run([*SHARDTUNE, *args], cwd=REPO, capture_output=True, check=True)
            times.append(time.perf_counter() - started)
        found[f"{name}_seconds"] = round(statistics.median(times), 3)
    return found


def median_row(runs: list[dict]) -> dict:
    """The first run's fields, with the measured numbers replaced by their medians over repeats."""
    row = dict(runs[0])
    for key in ("effective_tokens_per_second", "step_time_median_seconds", "first_step_seconds", "wall_seconds"):
        row[key] = round(statistics.median(r[key] for r in runs), 5)
    row["peak_memory_mib_per_rank"] = [max(values) for values in zip(*(r["peak_memory_mib_per_rank"] for r in runs),
                                                                     strict=True)]
    row["repeats"] = len(runs)
    row["tokens_per_second_each_repeat"] = [r["effective_tokens_per_second"] for r in runs]
    return row


def run_all(specs: list[RunSpec], config: str, repeats: int) -> list[dict]:
    runs: dict[RunSpec, list[dict]] = {spec: [] for spec in specs}
    with tempfile.TemporaryDirectory(prefix="shardtune-throughput-") as scratch:
        for repeat in range(repeats):
            for spec in specs:
                result = run_once(spec, config, Path(scratch))
                print(f"  [{repeat + 1}/{repeats}] {spec.suite}: {spec.label}, {spec.procs} proc: "
                      f"{result['effective_tokens_per_second']:.0f} tokens/s, first step after "
                      f"{result['first_step_seconds']} s", flush=True)
                runs[spec].append(result)
    return [median_row(found) for found in runs.values()]


def packing_summary(rows: list[dict]) -> dict:
    """Packed vs padded: the speed-up and how far each variant's loss per token is from the padded one."""
    by_name = {r["variant"]: r for r in rows if r["suite"] == "packing"}
    if "padded" not in by_name or "packed" not in by_name:
        return {}
    base = by_name["padded"]
    return {
        "packed_over_padded": round(by_name["packed"]["effective_tokens_per_second"]
                                    / base["effective_tokens_per_second"], 3),
        "loss_per_token_relative_difference": {
            name: abs(r["loss_per_token"] - base["loss_per_token"]) / base["loss_per_token"]
            for name, r in by_name.items()},
    }


def render_markdown(rows: list[dict], summary: dict, command: str, info: dict) -> str:
    out = [f"Command: `{command}`", "", machine_line(info), ""]
    if "startup" in summary:
        times = summary["startup"]
        out += [f"`shardtune --help`: {times['help_seconds']:.2f} s; `shardtune check {summary['config']}`: "
                f"{times['check_seconds']:.2f} s (median wall time of 5).", ""]
    if not rows:
        return "\n".join(out) + "\n"
    lines = ["| suite | variant | procs | engine | tokens/s | padding | step median | first step | loss/token | "
             "peak RSS per rank |", "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        memory = ", ".join(f"{m:.0f}" for m in r["peak_memory_mib_per_rank"])
        lines.append(f"| {r['suite']} | {r['variant']} | {r['processes']} | {r['engine']} | "
                     f"{r['effective_tokens_per_second']:,.0f} | {100 * r['padding_fraction']:.1f}% | "
                     f"{1000 * r['step_time_median_seconds']:.1f} ms | {r['first_step_seconds']:.1f} s | "
                     f"{r['loss_per_token']:.6f} | {memory} MiB |")
    out += [*lines, ""]
    if "packed_over_padded" in summary:
        worst = max(summary["loss_per_token_relative_difference"].values())
        out.append(f"Packed over padded: **{summary['packed_over_padded']:.2f}x** effective tokens/s; loss per token "
                   f"within {worst:.1e} (relative) of the padded run.")
    return "\n".join(out) + "\n"


def write_results(rows: list[dict], summary: dict, command: str, info: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"command": command, "machine": info, "summary": summary,
                                                   "rows": rows}, indent=2) + "\n")
    (out / f"{name}.md").write_text(render_markdown(rows, summary, command, info))
    if not rows:
        return
    columns = [k for k in rows[0] if k not in ("tokens_per_second_each_repeat",)]
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "peak_memory_mib_per_rank": " ".join(map(str, r["peak_memory_mib_per_rank"]))})


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=CONFIG, help="training YAML (default: %(default)s)")
    parser.add_argument("--suites", default="startup,packing,engines", help="any of startup, packing, engines")
    parser.add_argument("--engines", default="ddp,zero2,zero3,fsdp", help="engines suite: ddp, zero2, zero3, fsdp")
    parser.add_argument("--procs", default="1,2", help="engines suite: process counts")
    parser.add_argument("--steps", type=int, default=20, help="engines suite: measured steps after warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="engines suite: steps left out of the rates")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant (interleaved); median kept")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    parser.add_argument("--name", default="throughput", help="results file name stem")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    suites = args.suites.split(",")
    specs = packing_specs() if "packing" in suites else []
    if "engines" in suites:
        specs += engine_specs(args.engines.split(","), [int(n) for n in args.procs.split(",")], args.steps,
                              args.warmup)
    command = shlex.join(["python", "benchmarks/throughput.py", *argv])
    summary: dict = {"config": args.config}
    if "startup" in suites:
        summary["startup"] = startup_times(args.config)
    rows = run_all(specs, args.config, args.repeats)
    summary.update(packing_summary(rows))
    info = machine()
    write_results(rows, summary, command, info, args.out, args.name)
    print(render_markdown(rows, summary, command, info))
    print(f"results: {args.out / args.name}.{{json,csv,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
