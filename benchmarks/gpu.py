"""GPU throughput, MFU and peak memory of `shardtune train` under each engine, on a ~0.5B model.

    python benchmarks/gpu.py                                   # every engine, full and LoRA
    python benchmarks/gpu.py --engines local,ddp --finetuning full
    python benchmarks/gpu.py --shape tiny --allow-cpu --steps 3 # a check of this script on a machine without GPU

The model has random weights in the shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 key-value heads,
intermediate 4864, vocabulary 151936, tied embeddings), built from ``AutoConfig.for_model("qwen2", ...)`` with
shardtune's locally trained tokenizer: nothing is downloaded. ``--data pt`` (the default) is plain text cut into
packed rows of ``--cutoff`` tokens (stage ``pt``); ``--data sft`` is multi-turn chat (the bundled sharegpt demo,
repeated) packed with sample boundaries (stage ``sft``, ``packing: true``), the block-diagonal masks a user's SFT
run trains with. Both are tokenised once into ``--work-dir`` and reused by every run.

Each run is the real command line (``shardtune train CONFIG key=value ...``; FORCE_TORCHRUN and NPROC_PER_NODE in
its environment for every engine but ``local``), bf16, one run at a time. The numbers come from the run's own
``train_results.json``: effective tokens per second summed over ranks after ``--warmup`` steps, the median step
time, the peak accelerator memory each rank allocated from model loading on (``peak_memory_bytes_per_rank``).
MFU = model FLOPs per token x tokens/s per GPU / peak bf16 FLOP/s: the H200's dense bf16 datasheet figure
(989 TFLOP/s) and, beside it, the rate this script measures for an 8192^3 bf16 matrix product on the same GPU.
Model FLOPs per token (``flops_per_token``): full fine-tuning 6 x N + attention; LoRA 4 x N + 2 x N_trainable +
attention (frozen weights get the forward and the input gradient, no weight gradient; the adapters all three);
attention is 12 x layers x hidden x cutoff (PaLM's count, scores and values, forward and backward, without
halving for the causal mask). N counts every weight matmul (the tied output layer included, the embedding lookup
not).

Each run also profiles ``PROFILED_STEPS`` steps (``profile_steps``, train/profile.py: the GPU's busy fraction, host
syncs per step, the operators with the most CPU time), which its tokens/s leaves out; the second table shows them.

Results merge into ``benchmarks/results/gpu-<date>.{json,md}`` (rows of the same engine and finetuning type are
replaced), so the engines can be run in separate invocations; ``--out`` moves them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import machine, machine_line

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SHARDTUNE = [sys.executable, "-m", "shardtune.cli"]
H200_DENSE_BF16_FLOPS = 989e12  # NVIDIA H200 SXM datasheet, dense (no sparsity)
# Steps each run spends under torch.profiler (profile_steps; left out of its tokens/s, so the run is that longer).
PROFILED_STEPS = 3

SHAPES = {
    # Qwen2.5-0.5B's published config.json, weights random.
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Only for checking this script without a GPU.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=172, vocab_size=4096, max_position_embeddings=2048, tie_word_embeddings=True),
}
ENGINES = {
    "local": ("local", []),
    "ddp": ("DDP", []),
    "fsdp2": ("FSDP2 FULL_SHARD", ["fsdp=full_shard auto_wrap"]),
    "zero2": ("ZeRO-2", ["deepspeed=z2"]),
    "zero3": ("ZeRO-3", ["deepspeed=z3"]),
    # Regional compilation (torch_compile: each decoder layer through inductor), one process and under FSDP2.
    "local-compile": ("local + torch_compile", ["torch_compile=true"]),
    "fsdp2-compile": ("FSDP2 FULL_SHARD + torch_compile", ["fsdp=full_shard auto_wrap", "torch_compile=true"]),
}


def launched(engine: str) -> bool:
    """Every engine but one plain process runs under torchrun (FORCE_TORCHRUN)."""
    return not engine.startswith("local")


def lora_parameters(shape: dict, rank: int = 16) -> int:
    """Adapter parameters of LoRA rank ``rank`` on every linear layer of the decoder (q, k, v, o, gate, up, down)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, inter), (hidden, inter),
              (inter, hidden)]
    return shape["num_hidden_layers"] * sum(rank * (a + b) for a, b in shapes)


def flops_per_token(info: dict, finetuning: str, cutoff: int) -> float:
    """Model FLOPs of one trained token (see the module docstring)."""
    matmul_params = info["parameters"] - (0 if info.get("tie_word_embeddings") else info["embedding_parameters"])
    attention = 12 * info["num_hidden_layers"] * info["hidden_size"] * cutoff
    if finetuning == "lora":
        return 4 * matmul_params + 2 * lora_parameters(info) + attention
    return 6 * matmul_params + attention


@dataclass(frozen=True)
class Settings:
    steps: int
    warmup: int
    data: str
    micro_batch: int
    accumulation: int
    cutoff: int
    processes: int


def build_model(folder: Path, shape: str) -> dict:
    """A random Qwen2-architecture model of ``shape`` with shardtune's local tokenizer; returns its sizes."""
    info_file = folder / "shardtune_bench_model.json"
    if info_file.is_file():
        return json.loads(info_file.read_text())
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.model.tiny import build_tiny_tokenizer, bundled_corpus

    tokenizer = build_tiny_tokenizer(bundled_corpus(), vocab_size=2048)
    config = AutoConfig.for_model("qwen2", **SHAPES[shape], bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = {"shape": shape, "parameters": sum(p.numel() for p in model.parameters()),
            "embedding_parameters": model.get_input_embeddings().weight.numel(), **SHAPES[shape]}
    info_file.write_text(json.dumps(info, indent=2))
    return info


def write_dataset(folder: Path, min_chars: int, seed: int = 0) -> None:
    """Plain text for stage pt: the bundled corpus and demo text, shuffled and repeated to ``min_chars``."""
    if (folder / "dataset_info.json").is_file():
        return
    from shardtune.model.tiny import bundled_corpus

    demo = [json.loads(line)["text"] for line in (REPO / "data" / "demo_pt.jsonl").read_text().splitlines() if line]
    lines = [*bundled_corpus(), *demo]
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(folder / "bench_pt.jsonl", "w") as f:
        while written < min_chars:
            text = " ".join(rng.sample(lines, k=min(20, len(lines))))
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text)
    (folder / "dataset_info.json").write_text(json.dumps({"bench_pt": {"file_name": "bench_pt.jsonl",
                                                                       "columns": {"prompt": "text"}}}))


def write_sft_dataset(folder: Path, min_chars: int) -> None:
    """Multi-turn chat for stage sft: the bundled sharegpt demo conversations, repeated to ``min_chars``."""
    if (folder / "bench_sft.jsonl").is_file():
        return
    lines = [line for line in (REPO / "data" / "demo_sharegpt.jsonl").read_text().splitlines() if line]
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(folder / "bench_sft.jsonl", "w") as f:
        while written < min_chars:
            for line in lines:
                f.write(line + "\n")
                written += len(line)
    info = json.loads((folder / "dataset_info.json").read_text()) if (folder / "dataset_info.json").is_file() else {}
    demo = json.loads((REPO / "data" / "dataset_info.json").read_text())["demo_sharegpt"]
    info["bench_sft"] = {**demo, "file_name": "bench_sft.jsonl"}
    (folder / "dataset_info.json").write_text(json.dumps(info))


def write_config(work: Path, model: Path, s: Settings) -> Path:
    import yaml

    data = {"stage": "pt", "dataset": "bench_pt"} if s.data == "pt" else \
        {"stage": "sft", "dataset": "bench_sft", "template": "chatml"}
    config = {
        "model_name_or_path": str(model), **data, "do_train": True,
        "dataset_dir": str(work / "data"), "tokenized_path": str(work / f"tokenized-{s.data}-{s.cutoff}"),
        "cutoff_len": s.cutoff, "packing": True, "bf16": True, "lora_rank": 16, "learning_rate": 1.0e-5,
        "lr_scheduler_type": "constant", "warmup_ratio": 0.0, "per_device_train_batch_size": s.micro_batch,
        "gradient_accumulation_steps": s.accumulation, "max_steps": s.steps + s.warmup + PROFILED_STEPS,
        "profile_steps": PROFILED_STEPS,
        "throughput_warmup_steps": s.warmup, "logging_steps": 100000, "save_strategy": "no", "plot_loss": False,
        "report_to": ["none"], "overwrite_output_dir": True, "seed": 42,
    }
    path = work / f"bench_config_{s.data}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def command_for(engine: str, finetuning: str, config: Path, out: Path, processes: int) -> tuple[list[str], dict]:
    argv = [*SHARDTUNE, "train", str(config), f"output_dir={out}", f"finetuning_type={finetuning}",
            *ENGINES[engine][1]]
    env = {**os.environ}
    if launched(engine):
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(processes))
    return argv, env


def run_one(engine: str, finetuning: str, config: Path, work: Path, s: Settings, info: dict,
            peaks: dict[str, float | None]) -> dict:
    out = work / "runs" / f"{engine}-{finetuning}-{s.data}"
    argv, env = command_for(engine, finetuning, config, out, s.processes)
    started = time.time()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    row = {"engine": engine, "label": ENGINES[engine][0], "finetuning": finetuning, "data": s.data,
           "command": (f"FORCE_TORCHRUN=1 NPROC_PER_NODE={s.processes} " if launched(engine) else "")
           + shlex.join(["shardtune", *argv[len(SHARDTUNE):]])}
    if done.returncode != 0:
        # One engine failing must not cost the others' numbers: the row records the failure instead.
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        reasons = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if "failed" in line
                   or "error" in line]
        return {**row, "processes": s.processes, "error": (reasons or [f"exit code {done.returncode}"])[-1][:300]}
    results = json.loads((out / "train_results.json").read_text())
    gpus = results["world_size"]
    tokens_per_second = results["throughput"]["effective_tokens_per_second"]
    flops_per_gpu = flops_per_token(info, finetuning, s.cutoff) * tokens_per_second / gpus
    row.update({
        "processes": gpus, "engine_used": results["engine"], "tokens_per_second": tokens_per_second,
        "step_time_median_seconds": results["throughput"]["step_time_median_seconds"],
        "measured_steps": results["throughput"]["measured_steps"], "final_loss": results["final_loss"],
        "peak_memory_gib_per_rank": [round(b / 2**30, 2) for b in results["peak_memory_bytes_per_rank"]],
        "wall_seconds": round(time.time() - started, 1), "profile": results.get("profile"),
        "torch_compile": results.get("torch_compile"), "attention": results.get("attn_implementation"),
    })
    if "peak_setup_memory_bytes_per_rank" in results:
        row["peak_setup_memory_gib_per_rank"] = [round(b / 2**30, 2)
                                                 for b in results["peak_setup_memory_bytes_per_rank"]]
    for name, peak in peaks.items():
        row[f"mfu_{name}"] = round(flops_per_gpu / peak, 4) if peak else None
    return row


def write_results(stem: Path, rows: list[dict], meta: dict) -> None:
    """Merge ``rows`` into ``stem``.json (rows of the same engine, finetuning and data replaced) and render .md."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    merged = merge_rows(stem.with_suffix(".json"), rows)
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": merged}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(render_markdown(merged, meta))


def measured_bf16_matmul_flops(size: int = 8192, repeats: int = 10) -> float | None:
    """FLOP/s of an ``size``^3 bf16 matrix product on this GPU (mean of ``repeats`` after 3 warm-ups)."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / repeats
    del a, b
    torch.cuda.empty_cache()
    return 2 * size**3 / seconds


def merge_rows(path: Path, rows: list[dict]) -> list[dict]:
    """Earlier rows of this results file, with those of the same engine and finetuning type replaced."""
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    fresh = {(r["engine"], r["finetuning"], r.get("data", "pt")) for r in rows}
    order = list(ENGINES)
    merged = [r for r in old if (r["engine"], r["finetuning"], r.get("data", "pt")) not in fresh] + rows
    return sorted(merged, key=lambda r: (r.get("data", "pt"), r["finetuning"], order.index(r["engine"])))


def render_markdown(rows: list[dict], meta: dict) -> str:
    info, model, s = meta["machine"], meta["model"], meta["settings"]
    peak = meta["measured_bf16_matmul_tflops"]
    out = [
        f"# GPU benchmark, {meta['date']}", "", machine_line(info), "",
        f"Model: random weights, {model['shape']} shape (Qwen2 architecture), {model['parameters'] / 1e6:.1f}M "
        f"parameters ({model['embedding_parameters'] / 1e6:.1f}M of them the tied embedding). Data: packed rows of "
        f"{s['cutoff']} tokens (pt: plain text; sft: multi-turn chat, block-diagonal masks), micro-batch "
        f"{s['micro_batch']} x accumulation {s['accumulation']} per "
        f"process, bf16, {s['steps']} measured steps after {s['warmup']} of warm-up. LoRA: rank 16 on every linear "
        "layer.", "",
        "MFU = model FLOPs per token (full 6N + attention; LoRA 4N + 2N_trainable + attention) x tokens/s per GPU / "
        "peak: against the H100/H200 SXM dense bf16 datasheet figure "
        "(989 TFLOP/s) and against the measured 8192^3 bf16 matrix product"
        + (f" ({peak:.0f} TFLOP/s on this GPU)." if peak else " (not measured: no GPU)."), "",
        "| data | finetuning | engine | procs | tokens/s | step median | MFU (989) | MFU (measured) "
        "| peak memory per rank |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r.get('data', 'pt')} | {r['finetuning']} | {r['label']} | {r['processes']} | failed: "
                       f"{r['error']} | | | | |")
            continue
        mfu = [f"{100 * r[k]:.1f}%" if r.get(k) is not None else "-" for k in ("mfu_spec", "mfu_measured")]
        memory = ", ".join(f"{m:.2f}" for m in r["peak_memory_gib_per_rank"])
        kernel = f" ({r['attention']})" if r.get("attention") else ""  # sft's packed rows: varlen on a GPU
        out.append(f"| {r.get('data', 'pt')}{kernel} | {r['finetuning']} | {r['label']} | {r['processes']} | "
                   f"{r['tokens_per_second']:,.0f} | "
                   f"{1000 * r['step_time_median_seconds']:.0f} ms | {mfu[0]} | {mfu[1]} | {memory} GiB |")
    out += profile_table(rows)
    out += ["", "Commands (from the repository root; the config is written by the script):", ""]
    out += [f"- `{r['command']}`" for r in rows]
    return "\n".join(out) + "\n"


def profile_table(rows: list[dict]) -> list[str]:
    """Where each run's step goes: train_results.json's profile (torch.profiler over PROFILED_STEPS steps)."""
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return []
    out = ["", f"Where the step goes (`profile_steps: {PROFILED_STEPS}`, torch.profiler on rank 0, steps left out of "
           "tokens/s): the GPU's busy fraction is the union of its kernels' intervals over the profiled wall time; a "
           "host sync is a device value read into Python or an explicit synchronisation.", "",
           "| data | finetuning | engine | step (profiled) | GPU busy | host syncs per step | most CPU time per step |",
           "|---|---|---|---:|---:|---:|---|"]
    for r in profiled:
        p = r["profile"]
        busy = "-" if p["device_busy_fraction"] is None else f"{100 * p['device_busy_fraction']:.0f}%"
        top = ", ".join(f"{o['name']} {o['self_cpu_ms_per_step']:.1f} ms" for o in p["top_cpu_operators"][:3])
        out.append(f"| {r.get('data', 'pt')} | {r['finetuning']} | {r['label']} | {p['wall_ms_per_step']:.0f} ms | "
                   f"{busy} | {p['host_syncs_per_step']:g} | {top} |")
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES), help="any of %(default)s")
    parser.add_argument("--finetuning", default="full,lora", help="full, lora or both")
    parser.add_argument("--data", default="pt", choices=["pt", "sft"], help="plain text (pt) or packed multi-turn "
                        "chat (sft)")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the rates")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--cutoff", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--processes", type=int, default=0, help="processes for torchrun engines (default: GPUs)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardtune-bench-gpu"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (to check the script)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not args.allow_cpu:
        print("benchmarks/gpu.py needs a CUDA GPU (--allow-cpu runs it anyway, to check the script)")
        return 2
    s = Settings(args.steps, args.warmup, args.data, args.micro_batch, args.accumulation, args.cutoff,
                 args.processes or max(gpus, 1))
    work = args.work_dir / args.shape
    info = build_model(work / "model", args.shape)
    tokens_needed = (s.steps + s.warmup) * s.micro_batch * s.accumulation * s.cutoff * s.processes
    write_dataset(work / "data", min_chars=5 * tokens_needed)
    if s.data == "sft":
        write_sft_dataset(work / "data", min_chars=5 * tokens_needed)
    config = write_config(work, work / "model", s)
    measured = measured_bf16_matmul_flops()
    peaks = {"spec": H200_DENSE_BF16_FLOPS if gpus else None, "measured": measured}
    meta = {"date": args.date, "machine": machine(), "model": info, "settings": vars(s),
            "measured_bf16_matmul_tflops": measured / 1e12 if measured else None,
            "command": shlex.join(["python", "benchmarks/gpu.py", *argv])}
    rows: list[dict] = []
    # Engine by engine, full then LoRA, and the results written after every row: a device call cut off at its time
    # limit keeps the rows it finished.
    for engine in args.engines.split(","):
        for finetuning in args.finetuning.split(","):
            row = run_one(engine, finetuning, config, work, s, info, peaks)
            print(f"  {finetuning} {row['label']}: " + (f"FAILED: {row['error']}" if "error" in row else
                  f"{row['tokens_per_second']:,.0f} tokens/s, peak {row['peak_memory_gib_per_rank']} GiB"),
                  flush=True)
            rows.append(row)
            write_results(args.out / f"gpu-{args.date}", rows, meta)
    print(render_markdown(merge_rows(args.out / f"gpu-{args.date}.json", []), meta))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
