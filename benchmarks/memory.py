"""Memory: shardtune's estimate vs what a real 2-process CPU run holds, per model and engine.

    .venv/bin/python benchmarks/memory.py                       # every model x engine, results to benchmarks/results
    .venv/bin/python benchmarks/memory.py --models tiny --engines ddp,z3 --out /tmp/memory

For each model (random LLaMA built by `shardtune make-tiny-model`) and engine (DDP, ZeRO-2, ZeRO-3, FSDP
FULL_SHARD) it runs 2 ranks under torchrun, one run at a time, training ``examples/tiny/sft_full.yaml`` for 3
steps of 2 micro-batches through shardtune's own worker entry (`shardtune.launch.worker.worker_command`, what
`shardtune train` runs on every rank). The estimate is ``shardtune.estimate.config.estimate_for_run`` for the
same config and engine: model states + activations, no overhead.

What is measured, per rank: the anonymous resident memory (/proc/self/status RssAnon) the rank gained from just
before the model is loaded to the end of the last step, at its peak. Everything the process holds before that
point (interpreter and libraries, the tokenised data and loaders, the process group, DeepSpeed's communication
layer) is the baseline; modules the run would import lazily later (DeepSpeed imports tens of MiB inside
deepspeed.initialize) are imported before it, from a list one discovery run per engine records. The peak is the
larger of two lower bounds: RssAnon sampled every 2 ms, and VmHWM (reset at the baseline through
/proc/self/clear_refs, so no short peak is missed) minus the largest file-backed + shared RSS seen (library code
touched for the first time and the mmap'd checkpoint are not model memory). Two allocator settings make RSS follow
live tensors rather than glibc's caching: MALLOC_MMAP_THRESHOLD_ (large blocks are mmap'd and returned on free)
and MALLOC_ARENA_MAX=2. Packing makes every batch (nearly) cutoff_len long, the length the estimate assumes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common import machine, machine_line

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIG = "examples/tiny/sft_full.yaml"
NPROC = 2


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    micro_batch: int
    cutoff_len: int

    def make_args(self, out: Path) -> list[str]:
        return ["--out", str(out), "--layers", str(self.layers), "--hidden", str(self.hidden), "--heads",
                str(self.heads), "--kv-heads", str(self.kv_heads), "--intermediate", str(self.intermediate),
                "--vocab-size", str(self.vocab)]


# The bundled corpus trains a BPE of about 3.5k tokens at most, whatever vocab is asked for.
MODELS = {
    "tiny": ModelSpec("tiny", 2, 64, 4, 2, 172, 2048, 4, 256),
    "small": ModelSpec("small", 4, 256, 4, 2, 688, 4096, 4, 256),
    "medium": ModelSpec("medium", 8, 512, 8, 4, 1376, 4096, 2, 256),
    "large": ModelSpec("large", 12, 768, 12, 4, 2048, 4096, 2, 256),
}
ENGINES = {
    "ddp": [],
    "z2": ["deepspeed=z2"],
    "z3": ["deepspeed=z3"],
    "fsdp": ["fsdp=full_shard auto_wrap"],
}
ENGINE_TITLES = {"ddp": "DDP", "z2": "ZeRO-2", "z3": "ZeRO-3", "fsdp": "FSDP FULL_SHARD"}
RUN_ENV = {
    "OMP_NUM_THREADS": "1",  # two ranks on a shared 2-core machine
    "GLOO_SOCKET_IFNAME": "lo",
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_ARENA_MAX": "2",
    "TOKENIZERS_PARALLELISM": "false",
}


def run_overrides(spec: ModelSpec, model_dir: Path, out_dir: Path, steps: int, accumulation: int) -> list[str]:
    """key=value overrides on top of sft_full.yaml: short run, no eval or checkpoints, fixed-length batches."""
    return [f"model_name_or_path={model_dir}", f"output_dir={out_dir}", f"max_steps={steps}",
            f"per_device_train_batch_size={spec.micro_batch}", f"cutoff_len={spec.cutoff_len}",
            f"gradient_accumulation_steps={accumulation}", "packing=true", "val_size=0", "do_eval=false",
            "eval_strategy=no", "save_strategy=no", "plot_loss=false", "logging_steps=1",
            "build_tiny_model_if_missing=false"]


# --- the probe: runs inside each rank ---

class RssProbe:
    """Resident memory of this process: a baseline, then the peak since it (VmHWM after clear_refs)."""

    def __init__(self) -> None:
        self.baseline: dict[str, int] = {}
        self.marks: dict[str, dict[str, int]] = {}
        self.anon_peak = 0
        self.mapped_peak = 0  # file-backed + shared pages: code of lazily touched libraries, mmap'd checkpoint
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def status() -> dict[str, int]:
        fields = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
        return fields

    def start(self) -> None:
        import gc

        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.baseline = self.status()
        self.anon_peak = self.baseline["RssAnon"]
        self.mapped_peak = self.baseline["RssFile"] + self.baseline["RssShmem"]
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        # A cross-check of VmHWM that excludes file pages (libraries mapped lazily, the mmap'd checkpoint).
        while not self._stop.wait(0.002):
            self._record(self.status())

    def _record(self, fields: dict[str, int]) -> None:
        self.anon_peak = max(self.anon_peak, fields["RssAnon"])
        self.mapped_peak = max(self.mapped_peak, fields["RssFile"] + fields["RssShmem"])

    def mark(self, name: str) -> None:
        self.marks[name] = self.status()
        self._record(self.marks[name])

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        end = self.status()
        self._record(end)
        # VmHWM is exact but counts file pages too; at the moment of the peak they were at most mapped_peak,
        # so VmHWM - mapped_peak is anonymous memory that was certainly resident then. The sampled RssAnon
        # peak is another lower bound; the larger of the two is the measurement.
        anon_at_hwm = end["VmHWM"] - self.mapped_peak
        anon_peak = max(self.anon_peak, anon_at_hwm)
        setup = self.marks.get("before_loop", end)
        return {"baseline": self.baseline, "end": end, "marks": self.marks,
                "rss_peak_delta": end["VmHWM"] - self.baseline["VmRSS"],
                # The high-water mark when the loop began: the model built, loaded and sharded, the optimizer made.
                "setup_rss_peak_delta": setup["VmHWM"] - self.baseline["VmRSS"],
                "anon_sampled_delta": self.anon_peak - self.baseline["RssAnon"],
                "anon_at_hwm_delta": anon_at_hwm - self.baseline["RssAnon"],
                "peak_delta": anon_peak - self.baseline["RssAnon"]}


def probe_main(argv: list[str]) -> int:
    """One rank: shardtune's worker with the model load and the loop instrumented; writes --result FILE."""
    result_path, preload = Path(option_value(argv, "--result")), option_value(argv, "--preload")
    argv = [a for i, a in enumerate(argv) if a not in ("--result", "--preload")
            and argv[i - 1] not in ("--result", "--preload")]
    preload_libraries(argv, Path(preload) if preload else None)
    from shardtune.launch.worker import worker_command
    from shardtune.train import loop, workflow

    probe, shapes = RssProbe(), []
    make_source, run_loop, train_step = workflow.model_source, workflow.run_loop, loop.train_step

    modules_at_baseline: set[str] = set()

    def source_after_baseline(*args, **kwargs):
        # The engine loads (and shards) the model from this source; "before_loop" marks the end of that set-up.
        start_communication_runtime(argv)
        modules_at_baseline.update(sys.modules)
        probe.start()
        return make_source(*args, **kwargs)

    def step_and_mark(engine, window, *args, **kwargs):
        shapes.extend(list(b["input_ids"].shape) for b in window)
        metrics = train_step(engine, window, *args, **kwargs)
        probe.mark(f"after_step_{len(probe.marks)}")
        return metrics

    def loop_then_stop(engine, *args, **kwargs):
        probe.mark("before_loop")
        state = run_loop(engine, *args, **kwargs)
        report = probe.stop()
        report.update(rank=engine.rank, engine=engine.name, batch_shapes=shapes,
                      imported_after_baseline=sorted(set(sys.modules) - modules_at_baseline))
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.with_name(f"{result_path.stem}.rank{engine.rank}.json").write_text(json.dumps(report, indent=1))
        return state

    workflow.model_source = source_after_baseline
    workflow.run_loop = loop_then_stop
    workflow.finish_run = finish_without_saving
    loop.train_step = step_and_mark
    return worker_command(argv)


def option_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def preload_libraries(argv: list[str], module_list: Path | None) -> None:
    """Import what the run imports lazily, so that imports never count as model memory.

    ``module_list`` holds the modules a first (discovery) run of the same engine imported after its baseline
    (DeepSpeed, for one, imports its Muon optimizer module, tens of MiB, inside deepspeed.initialize).
    """
    import importlib

    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    if any(a.startswith("deepspeed=") for a in argv):
        import deepspeed  # noqa: F401
    names = json.loads(module_list.read_text()) if module_list and module_list.is_file() else []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that only imports in its original context stays lazy
            pass


def start_communication_runtime(argv: list[str]) -> None:
    """DeepSpeed's own communication layer (on CPU a compiled shared-memory op with its workspace) starts inside
    deepspeed.initialize; start it before the baseline, as the process group itself is, since it is runtime."""
    if any(a.startswith("deepspeed=") for a in argv):
        import deepspeed.comm

        deepspeed.comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)


def finish_without_saving(engine, tokenizer, c, output_dir, state, hooks, memory=None):
    """The measurement ends with the loop; saving the model would only cost time and disk."""
    hooks.reporter.close()
    engine.barrier()
    engine.close()
    return {"final_loss": hooks.train_losses[-1], "global_step": state.global_step, "engine": engine.name,
            "world_size": engine.world_size}


# --- the orchestrator ---

def ensure_model(spec: ModelSpec, work: Path) -> Path:
    out = work / "models" / spec.name
    if not (out / "config.json").is_file():
        cmd = [str(REPO / ".venv" / "bin" / "shardtune"), "make-tiny-model", *spec.make_args(out)]
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


def probe_command(spec: ModelSpec, engine: str, model_dir: Path, work: Path, steps: int, accumulation: int,
                  preload: Path | None) -> tuple[list[str], Path]:
    result = work / "probe" / f"{spec.name}-{engine}-ga{accumulation}{'' if preload else '-discovery'}.json"
    overrides = run_overrides(spec, model_dir, work / "runs" / f"{spec.name}-{engine}", steps, accumulation)
    argv = [CONFIG, *overrides, *ENGINES[engine]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
           str(Path(__file__).resolve()), "probe", "--result", str(result), *argv]
    if preload is not None:
        cmd[cmd.index("--result"):cmd.index("--result")] = ["--preload", str(preload)]
    return cmd, result


def run_probe(cmd: list[str], result: Path) -> list[dict]:
    """Run one 2-rank probe and return each rank's report."""
    for old in result.parent.glob(f"{result.stem}.rank*.json"):
        old.unlink()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **RUN_ENV}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(result.parent.glob(f"{result.stem}.rank*.json"))]


def discover_imports(engine: str, work: Path) -> Path:
    """Modules an engine imports only once training starts, found by one run of the tiny model (cached)."""
    listing = work / f"preload-{engine}.json"
    if not listing.is_file():
        spec = MODELS["tiny"]
        cmd, result = probe_command(spec, engine, ensure_model(spec, work), work, 1, 2, preload=None)
        ranks = run_probe(cmd, result)
        listing.write_text(json.dumps(sorted({m for r in ranks for m in r["imported_after_baseline"]})))
    return listing


def estimate_row(argv: list[str], engine: str) -> dict:
    """The estimate shardtune makes for this config and engine (what train_results.json records)."""
    from shardtune.config.args import load_config
    from shardtune.engines.plan import plan_engine
    from shardtune.estimate.config import configured_option, estimate_for_run, estimate_run_memory, hardware_for

    config, _ = load_config(argv)
    plan, problems = plan_engine(config, NPROC, has_cuda=False)
    assert not problems, problems
    measurable = estimate_for_run(config, NPROC, plan.kind, fsdp_settings=plan.fsdp, deepspeed_raw=plan.deepspeed_raw,
                                  local_world_size=NPROC)
    run = estimate_run_memory(config, NPROC, plan.kind, fsdp_settings=plan.fsdp, deepspeed_raw=plan.deepspeed_raw,
                              local_world_size=NPROC)
    option = configured_option(config, hardware_for(NPROC, NPROC, None, 0))
    return {"estimate": measurable, "setup_estimate": run.setup if run else None, "option": option.name,
            "components": option.device.to_dict()}


def run_one(spec: ModelSpec, engine: str, work: Path, steps: int, accumulation: int) -> dict:
    model_dir = ensure_model(spec, work)
    cmd, result = probe_command(spec, engine, model_dir, work, steps, accumulation,
                                discover_imports(engine, work))
    start = time.perf_counter()
    ranks = run_probe(cmd, result)
    row = estimate_row(cmd[cmd.index(CONFIG):], engine)
    measured = max(r["peak_delta"] for r in ranks)
    row.update(model=spec.name, engine=ENGINE_TITLES[engine], params=model_params(model_dir),
               measured=measured, measured_rss=max(r["rss_peak_delta"] for r in ranks),
               measured_setup_rss=max(r["setup_rss_peak_delta"] for r in ranks),
               per_rank=[r["peak_delta"] for r in ranks], seconds=round(time.perf_counter() - start, 1),
               batch_shapes=sorted({tuple(s) for r in ranks for s in r["batch_shapes"]}),
               late_imports=max(len(r["imported_after_baseline"]) for r in ranks),
               error=(row["estimate"] - measured) / measured)
    return row


def model_params(model_dir: Path) -> int:
    from shardtune.estimate.shape import load_model_shape

    return load_model_shape(str(model_dir)).total_params


def render_markdown(rows: list[dict], command: str, info: dict, accumulation: int) -> str:
    lines = ["| model | params | engine | estimate | measured | error | RSS incl. file pages | loading peak: "
             "estimate | loading peak: RSS measured |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        setup = mib(r["setup_estimate"]) if r.get("setup_estimate") is not None else "-"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['engine']} | {mib(r['estimate'])} | "
                     f"{mib(r['measured'])} | {100 * r['error']:+.1f}% | {mib(r['measured_rss'])} | {setup} | "
                     f"{mib(r['measured_setup_rss'])} |")
    worst = max(abs(r["error"]) for r in rows)
    footer = f"Largest error: {100 * worst:.1f}% (gradient_accumulation_steps {accumulation})."
    if accumulation == 1:
        footer += (" Without accumulation DDP and FSDP free gradients between steps and the backward creates them"
                   " while it frees activations, so the estimate's sum is an upper bound (benchmarks/README.md).")
    return "\n".join([f"Command: `{command}`", "",
                      machine_line(info),
                      "", *lines, "", footer])


def mib(num: float) -> str:
    return f"{num / 2**20:.1f} MiB"


def main(argv: list[str]) -> int:
    if argv and argv[0] == "probe":
        return probe_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2,
                        help="2 (the examples' setting) keeps gradients across micro-batches: the estimate's sum")
    parser.add_argument("--work-dir", default="/tmp/shardtune-bench-memory")
    parser.add_argument("--out", default=str(RESULTS / "memory"), help="results prefix (.json and .md are added)")
    ns = parser.parse_args(argv)
    work = Path(ns.work_dir)
    rows = []
    for model in ns.models.split(","):
        for engine in ns.engines.split(","):
            row = run_one(MODELS[model], engine, work, ns.steps, ns.gradient_accumulation_steps)
            rows.append(row)
            print(f"{row['model']:>6} {row['engine']:<16} estimate {mib(row['estimate']):>12}  measured "
                  f"{mib(row['measured']):>12}  error {100 * row['error']:+6.1f}%  ({row['seconds']} s)", flush=True)
    command = shlex.join([".venv/bin/python", "benchmarks/memory.py", *argv])
    info = machine()
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    ga = ns.gradient_accumulation_steps
    Path(ns.out + ".json").write_text(json.dumps({"command": command, "machine": info,
                                                  "gradient_accumulation_steps": ga, "rows": rows}, indent=1))
    Path(ns.out + ".md").write_text(render_markdown(rows, command, info, ga) + "\n")
    print(render_markdown(rows, command, info, ga))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
