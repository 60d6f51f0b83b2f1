"""What a checkpoint save holds training for, with and without ``async_save``, on a model of ~270M parameters (CPU).

One process (the local engine, full fine-tuning, AdamW): weights, gradients and Adam moments in fp32, so a checkpoint
is about 3.3 GB (weights + optimizer state). In one run, alternating, ``--repeats`` saves each way through the same
code the loop calls (train/checkpoint.py ``CheckpointSaver``):

* synchronous: every file serialised, written and fsynced before the save returns;
* async_save: the state staged into host memory, the save returns, the files are written by the background thread
  while training steps run; reported: the seconds the save held the loop ("blocked"), the write's duration, and
  the steps' time while the write runs against the steps' time without one.

    .venv/bin/python benchmarks/async_checkpoint_cpu.py [--repeats 3] [--out DIR]

Writes results/async_checkpoint_cpu.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from common import machine, machine_line  # noqa: E402

from shardtune.engines.base import PrecisionSettings  # noqa: E402
from shardtune.engines.checkpoint_writer import SaveTimes  # noqa: E402
from shardtune.engines.local import LocalEngine  # noqa: E402
from shardtune.train.checkpoint import CheckpointSaver  # noqa: E402
from shardtune.train.loop import TrainState  # noqa: E402

SHAPE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 32000, "max_position_embeddings": 256}


def build_engine() -> LocalEngine:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False))
    engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
    engine.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-5),
                   lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda _step: 1.0))
    return engine


def train_step(engine: LocalEngine) -> float:
    started = time.perf_counter()
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 16))
    engine.model(input_ids=ids, labels=ids).loss.backward()
    engine.step(1.0)
    return time.perf_counter() - started


def timed_save(engine: LocalEngine, saver: CheckpointSaver, step: int, reported: list[SaveTimes]) -> dict[str, float]:
    """One save by the run's saver (kept for the whole run, as the loop keeps it): seconds blocked, seconds
    writing, and the training steps run meanwhile."""
    background = saver.writer.background
    started = time.perf_counter()
    saver.save(TrainState(global_step=step))
    blocked = time.perf_counter() - started
    steps_during = []
    while background and not saver.writer.finished():
        steps_during.append(train_step(engine))
    saver.finish()  # calls on_saved, which appends to ``reported``
    return {"blocked_s": blocked, "write_s": reported[-1].written,
            "total_s": time.perf_counter() - started, "steps_during_write": len(steps_during),
            "step_s_during_write": statistics.median(steps_during) if steps_during else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--scratch", default=None, help="folder the checkpoints are written to (default: a temp dir)")
    args = parser.parse_args()
    engine = build_engine()
    params = sum(p.numel() for p in engine.model.parameters())
    for _ in range(2):  # Adam's moments exist from the first step on
        train_step(engine)
    plain_steps = [train_step(engine) for _ in range(3)]
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    scratch = Path(tempfile.mkdtemp(prefix="async-ckpt-", dir=args.scratch))
    reported: list[SaveTimes] = []
    savers = {mode: CheckpointSaver(engine, scratch / mode, save_total_limit=None, background=mode == "async",
                                    on_saved=lambda _step, times: reported.append(times)) for mode in runs}
    try:
        for repeat in range(args.repeats):
            for mode in (("sync", "async") if repeat % 2 == 0 else ("async", "sync")):
                result = timed_save(engine, savers[mode], repeat + 1, reported)
                folder = scratch / mode / f"checkpoint-{repeat + 1}"
                result["bytes"] = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
                runs[mode].append(result)
                shutil.rmtree(folder)
                print(mode, {k: round(v, 3) for k, v in result.items()}, flush=True)
    finally:
        for saver in savers.values():
            saver.close()
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarise(runs, plain_steps, params)
    write_results(Path(args.out), summary, runs)


def summarise(runs: dict[str, list[dict[str, float]]], plain_steps: list[float], params: int) -> dict:
    """Medians; async_save's first save (which also allocates its host copies) apart from the later ones."""
    later = {"sync": runs["sync"], "async": runs["async"][1:] or runs["async"]}
    med = {mode: {key: statistics.median(r[key] for r in results) for key in results[0]}
           for mode, results in later.items()}
    return {"parameters": params, "checkpoint_bytes": med["sync"]["bytes"], "sync": med["sync"],
            "async": med["async"], "async_first": runs["async"][0],
            "blocked_ratio": med["async"]["blocked_s"] / med["sync"]["blocked_s"],
            "first_blocked_ratio": runs["async"][0]["blocked_s"] / med["sync"]["blocked_s"],
            "step_s_without_write": statistics.median(plain_steps)}


def write_results(out: Path, summary: dict, runs: dict) -> None:
    info = machine()
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_checkpoint_cpu.json").write_text(json.dumps({"machine": info, "summary": summary, "runs": runs},
                                                              indent=2))
    s, a = summary["sync"], summary["async"]
    lines = [
        "# async_save: what a save holds training for (CPU)", "",
        f"`benchmarks/async_checkpoint_cpu.py`, {time.strftime('%Y-%m-%d')}. {machine_line(info)}", "",
        f"Model: LLaMA shape {SHAPE['num_hidden_layers']} layers x hidden {SHAPE['hidden_size']} "
        f"({summary['parameters'] / 1e6:.0f}M parameters), fp32, full fine-tuning, AdamW, one process (local "
        f"engine); checkpoint {summary['checkpoint_bytes'] / 2**30:.2f} GiB (weights + optimizer state). Medians of "
        f"{len(runs['sync'])} synchronous saves and of async_save's saves after its first, alternated in one run "
        "(one saver each, kept for the run as the loop keeps it).", "",
        "| save | training held (s) | files written in (s) |", "|---|---|---|",
        f"| synchronous | {s['blocked_s']:.2f} | {s['write_s']:.2f} |",
        f"| async_save, first save (allocates its host copies) | {summary['async_first']['blocked_s']:.2f} | "
        f"{summary['async_first']['write_s']:.2f} (in the background) |",
        f"| async_save, later saves | {a['blocked_s']:.2f} | {a['write_s']:.2f} (in the background) |", "",
        f"**Blocked time with async_save: {summary['blocked_ratio']:.1%} of the synchronous save's** "
        f"(first save: {summary['first_blocked_ratio']:.1%}).", "",
        f"Training step while the background write runs: {a['step_s_during_write']:.2f} s against "
        f"{summary['step_s_without_write']:.2f} s without one ({a['steps_during_write']:.0f} steps ran during each "
        "write; the writer thread and the step share the 2 cores).",
    ]
    (out / "async_checkpoint_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
