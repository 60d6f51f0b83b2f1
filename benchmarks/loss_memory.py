"""Loss memory and time: the full-logits loss against the chunked one (loss_chunk_size), one CPU process.

    .venv/bin/python benchmarks/loss_memory.py                      # results to benchmarks/results/loss_memory.*
    .venv/bin/python benchmarks/loss_memory.py --chunks 0,1024 --precisions fp32 --repeats 2 --out /tmp/loss

A random LLaMA with a large vocabulary and a small body (hidden 128, 2 layers, vocabulary 151,936 as Qwen2's),
full fine-tuning, one micro-batch of 2048 tokens, every position trainable (pre-training): the shape in which
the logits dominate. Each variant is one forward + backward of ``shardtune.train.loop.token_loss_sum`` (what the
training loop runs) with the given ``loss_chunk_size`` (0: the full logits), from a state without gradients.
Variants run interleaved in one process (A B C A B C, after one warm-up round), so machine load hits all alike;
each row is the median. Time is the process's CPU time (one torch thread, so it is the work done, and other
processes on a shared machine barely change it) and, beside it, the wall time.

Peak memory is the resident memory the step gained, at its peak: VmHWM is reset to the current RSS through
/proc/self/clear_refs just before the step, and the peak is VmHWM after it minus VmRSS before it. The script
re-executes itself with MALLOC_MMAP_THRESHOLD_=65536 and MALLOC_ARENA_MAX=2 so that glibc returns freed tensors
to the system and RSS follows live tensors (as benchmarks/memory.py does); tensors this large are mmap'd by
glibc anyway, so the setting does not change the timing. The warm-up round touches the library code first, so
file-backed pages do not enter the measured peaks.

Beside each variant: shardtune's estimate of the logits term (shardtune.estimate.activations.logits_bytes) and of
what the step holds at its peak (activations + gradients + autocast weight copies).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from common import machine, machine_line

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}
MODEL = {"vocab_size": 151936, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
         "tie_word_embeddings": False}


def memory_status() -> dict[str, int]:
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, value = line.split(":", 1)
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def build_model(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="sdpa"))


def build_batch(tokens: int, seed: int = 1) -> dict:
    import torch

    ids = torch.randint(0, MODEL["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def measure_step(model, batch: dict, chunk_size: int, precision: str) -> dict:
    """One forward + backward from a state without gradients: peak RSS gained, wall and CPU seconds, loss."""
    import torch

    from shardtune.train.loop import token_loss_sum

    model.zero_grad(set_to_none=True)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = memory_status()["VmRSS"]
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss, _ = token_loss_sum(model, batch, chunk_size)
    loss.backward()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = memory_status()["VmHWM"] - before
    return {"peak_bytes": peak, "seconds": seconds, "cpu_seconds": cpu_seconds, "loss": float(loss.detach())}


def estimate(tokens: int, chunk_size: int, precision: str) -> dict:
    """The estimate's logits term and its activations + gradients + autocast weight copies for this step."""
    from shardtune.estimate.activations import activation_bytes, autocast_weight_copy_bytes, logits_bytes
    from shardtune.estimate.shape import shape_from_config
    from shardtune.estimate.workload import Workload

    shape = shape_from_config({**MODEL, "model_type": "llama"})
    w = Workload(micro_batch=1, seq_len=tokens, precision=precision, finetuning_type="full",
                 loss_chunk_size=chunk_size)
    step = activation_bytes(shape, w, 4) + 4 * shape.total_params + autocast_weight_copy_bytes(shape, w)
    return {"logits_bytes": logits_bytes(shape, w), "step_bytes": step}


def run(chunks: list[int], precisions: list[str], tokens: int, repeats: int, threads: int) -> list[dict]:
    import torch

    torch.set_num_threads(threads)
    model, batch = build_model(), build_batch(tokens)
    variants = [(p, c) for p in precisions for c in chunks]
    samples: dict[tuple[str, int], list[dict]] = {v: [] for v in variants}
    for round_index in range(repeats + 1):
        for precision, chunk in variants:
            found = measure_step(model, batch, chunk, precision)
            if round_index > 0:  # round 0 warms up code paths and allocator
                samples[(precision, chunk)].append(found)
            print(f"round {round_index} {precision} chunk {chunk:>5}: {found['peak_bytes'] / 2**20:8.1f} MiB "
                  f"{found['seconds']:6.2f} s ({found['cpu_seconds']:6.2f} s CPU)  loss {found['loss']:.4f}",
                  flush=True)
    return [summarise(precision, chunk, samples[(precision, chunk)], tokens) for precision, chunk in variants]


def summarise(precision: str, chunk: int, runs: list[dict], tokens: int) -> dict:
    return {"precision": precision, "loss_chunk_size": chunk, "tokens": tokens,
            "peak_bytes": statistics.median(r["peak_bytes"] for r in runs),
            "seconds": statistics.median(r["seconds"] for r in runs),
            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
            "peak_bytes_runs": [r["peak_bytes"] for r in runs], "seconds_runs": [round(r["seconds"], 3) for r in runs],
            "cpu_seconds_runs": [round(r["cpu_seconds"], 3) for r in runs],
            "loss": runs[0]["loss"], **estimate(tokens, chunk, precision)}


def with_drops(rows: list[dict]) -> list[dict]:
    """Each chunked row against the full-logits row of its precision: measured and estimated memory drop."""
    full = {r["precision"]: r for r in rows if r["loss_chunk_size"] == 0}
    for r in rows:
        base = full.get(r["precision"])
        if base is None:
            continue
        r["measured_drop_bytes"] = base["peak_bytes"] - r["peak_bytes"]
        r["estimated_drop_bytes"] = base["step_bytes"] - r["step_bytes"]
        r["speedup"] = base["seconds"] / r["seconds"]
        r["cpu_speedup"] = base["cpu_seconds"] / r["cpu_seconds"]
        r["loss_rel_diff"] = abs(r["loss"] - base["loss"]) / abs(base["loss"])
    return rows


def mib(num: float) -> str:
    return f"{num / 2**20:,.0f} MiB"


def render_markdown(rows: list[dict], command: str, info: dict, threads: int) -> str:
    tokens = rows[0]["tokens"]
    lines = ["| precision | loss_chunk_size | peak RSS gained | step CPU time | step wall time | "
             "vs full logits: memory | CPU time | estimate: logits term | estimate: step | estimate: drop | "
             "loss rel. diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        chunk = "0 (full logits)" if r["loss_chunk_size"] == 0 else str(r["loss_chunk_size"])
        drop = f"-{mib(r['measured_drop_bytes'])}" if r["loss_chunk_size"] else ""
        speed = f"{r['cpu_speedup']:.2f}x" if r["loss_chunk_size"] else ""
        estimated = f"-{mib(r['estimated_drop_bytes'])}" if r["loss_chunk_size"] else ""
        loss = f"{r['loss_rel_diff']:.1e}" if r["loss_chunk_size"] else ""
        lines.append(f"| {r['precision']} | {chunk} | {mib(r['peak_bytes'])} | {r['cpu_seconds']:.2f} s | "
                     f"{r['seconds']:.2f} s | {drop} | {speed} | {mib(r['logits_bytes'])} | {mib(r['step_bytes'])} | "
                     f"{estimated} | {loss} |")
    regime = (f"Regime: one CPU process, {threads} thread(s); random LLaMA, hidden {MODEL['hidden_size']}, "
              f"{MODEL['num_hidden_layers']} layers, vocabulary {MODEL['vocab_size']:,}, untied head, full "
              f"fine-tuning; one micro-batch of {tokens} tokens, all trainable; median of the interleaved rounds.")
    return "\n".join([f"Command: `{command}`", "", machine_line(info), "", regime, "", *lines])


def main(argv: list[str]) -> int:
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        # glibc reads these at start-up: re-execute so RSS follows live tensors.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", default="0,256,512,1024,2048", help="loss_chunk_size values (0: full logits)")
    parser.add_argument("--precisions", default="fp32,bf16", help="fp32 and/or bf16 (autocast)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the micro-batch")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds after the warm-up round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--out", default=str(RESULTS / "loss_memory"), help="results prefix (.json and .md added)")
    ns = parser.parse_args(argv)
    rows = with_drops(run([int(c) for c in ns.chunks.split(",")], ns.precisions.split(","), ns.tokens,
                          ns.repeats, ns.threads))
    command = shlex.join([".venv/bin/python", "benchmarks/loss_memory.py", *argv])
    info = machine()
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out + ".json").write_text(json.dumps({"command": command, "machine": info, "model": MODEL,
                                                  "threads": ns.threads, "rows": rows}, indent=1))
    Path(ns.out + ".md").write_text(render_markdown(rows, command, info, ns.threads) + "\n")
    print(render_markdown(rows, command, info, ns.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
