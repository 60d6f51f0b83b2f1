"""A LLaMA-Factory LoRA file on the GPU: bf16, 4-bit bitsandbytes base (QLoRA), sdpa or fa2 attention, activation
checkpointing on and off, through the real command line.

    python benchmarks/gpu_llamafactory.py                       # on a GPU machine (scripts/gpu_check.sh lf-qlora)
    python benchmarks/gpu_llamafactory.py --shape tiny --check-script   # this script's own check, no GPU needed

The run is LLaMA-Factory's own example layout: ``tests/fixtures/llamafactory/qwen3_lora_sft.yaml`` and its data
folder (alpaca, identity, glaive tool calls; an eval set in OpenAI messages), copied to a work folder and trained
with ``shardtune train qwen3_lora_sft.yaml KEY=VALUE ...``. Only the model, data folder and output folder come
from here, plus the keys under test: ``quantization_bit: 4``, ``quantization_method: bnb``, ``flash_attn``
(``fa2`` where the flash-attn package is installed, else ``sdpa``), ``bf16: true`` and
activation checkpointing on, then off (LLaMA-Factory's ``disable_gradient_checkpointing``). The model has random
weights in the shape of Qwen2.5-0.5B (benchmarks/gpu.py builds it; nothing is downloaded).

The script checks what a user would: both runs finish, losses are finite and fall, activation checkpointing
changes the losses by no more than bf16 rounding and lowers the measured peak memory, the frozen weights were
4-bit (fewer stored elements than the model has parameters), the attention kernel asked for is the one recorded,
and the saved adapter loads onto the unquantised base model. It exits 1 when a check fails. Results go to
``benchmarks/results/gpu-<date>-llamafactory.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import machine, machine_line

from gpu import build_model

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "llamafactory"
RESULTS = REPO / "benchmarks" / "results"
SHARDTUNE = [sys.executable, "-m", "shardtune.cli"]
BF16_RTOL = 2e-2  # the same batches with and without recomputation differ only by bf16 rounding
TRAINABLE_LINE = re.compile(r"trainable params ([\d,]+) of ([\d,]+)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "tiny"])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardtune-gpu-llamafactory"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--check-script", action="store_true",
                        help="no GPU: train without 4-bit and bf16, to check this script itself")
    return parser.parse_args(argv)


def attention_kernel() -> str:
    return "fa2" if importlib.util.find_spec("flash_attn") else "sdpa"


def overrides(model: Path, out: Path, checkpointing: bool, check_script: bool) -> list[str]:
    keys = [f"model_name_or_path={model}", "dataset_dir=data", f"output_dir={out}",
            f"flash_attn={attention_kernel()}", f"disable_gradient_checkpointing={str(not checkpointing).lower()}",
            # Enough tokens per step for activations to matter, a few epochs of the small demo data.
            "per_device_train_batch_size=8", "gradient_accumulation_steps=1", "num_train_epochs=3",
            "cutoff_len=1024", "logging_steps=1", "eval_strategy=no", "lora_dropout=0"]
    if check_script:
        return [*keys, "bf16=false"]
    return [*keys, "quantization_bit=4", "quantization_method=bnb", "bf16=true"]


def run_one(work: Path, model: Path, checkpointing: bool, check_script: bool) -> dict:
    out = work / "runs" / f"checkpointing-{str(checkpointing).lower()}"
    shutil.rmtree(out, ignore_errors=True)
    argv = [*SHARDTUNE, "train", "qwen3_lora_sft.yaml", *overrides(model, out, checkpointing, check_script)]
    started = time.time()
    done = subprocess.run(argv, cwd=work / "lf", env={**os.environ}, capture_output=True, text=True)
    row = {"gradient_checkpointing": checkpointing, "command": shlex.join(["shardtune", *argv[len(SHARDTUNE):]]),
           "exit_code": done.returncode, "wall_seconds": round(time.time() - started, 1)}
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        return {**row, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    results = json.loads((out / "train_results.json").read_text())
    logged = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if line]
    resolved = json.loads((out / "shardtune_config.json").read_text())
    trainable = TRAINABLE_LINE.search(done.stdout + done.stderr)
    row.update({
        "out": str(out), "engine": results["engine"], "global_step": results["global_step"],
        "losses": [r["loss"] for r in logged if "loss" in r], "final_loss": results["final_loss"],
        "tokens_per_second": results["throughput"]["effective_tokens_per_second"],
        "step_time_median_seconds": results["throughput"]["step_time_median_seconds"],
        "peak_memory_bytes": results["peak_memory_bytes_per_rank"][0],
        "estimated_memory_bytes": results.get("estimated_memory_bytes"),
        "attn_implementation": resolved.get("attn_implementation"),
        "trainable_parameter_dtypes": results.get("trainable_parameter_dtypes"),
        "stored_elements": int(trainable.group(2).replace(",", "")) if trainable else None,
    })
    return row


def adapter_loads(out: Path, base: Path) -> bool:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), out)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    return bool(lora_b) and all(p.abs().sum() > 0 for p in lora_b)


def checks(rows: list[dict], info: dict, base: Path, check_script: bool) -> list[tuple[str, bool]]:
    if any("error" in r for r in rows):
        return [("both runs finish", False)]
    on, off = rows
    lora_parameters = on["stored_elements"] - info["parameters"] if not check_script else 0
    found = [
        ("both runs finish", True),
        ("losses finite and falling", all(math.isfinite(x) for r in rows for x in r["losses"])
         and all(r["losses"][-1] < r["losses"][0] for r in rows)),
        (f"activation checkpointing keeps the losses (rel {BF16_RTOL})",
         len(on["losses"]) == len(off["losses"])
         and all(abs(a - b) <= BF16_RTOL * abs(b) for a, b in zip(on["losses"], off["losses"], strict=True))),
        ("activation checkpointing lowers the peak memory", on["peak_memory_bytes"] < off["peak_memory_bytes"]),
        (f"attention kernel recorded as {attention_kernel()}",
         all(r["attn_implementation"] in (attention_kernel(), "flash_attention_2" if attention_kernel() == "fa2"
                                          else "sdpa") for r in rows)),
        ("LoRA weights train in float32", all(r["trainable_parameter_dtypes"] == ["float32"] for r in rows)),
        ("saved adapter loads onto the unquantised base", all(adapter_loads(Path(r["out"]), base) for r in rows)),
    ]
    if not check_script:
        # bitsandbytes stores two 4-bit values per uint8 element: a quantised model holds fewer elements than it
        # has parameters, even with the LoRA matrices added.
        found.append(("frozen weights stored in 4 bits", lora_parameters < 0))
    return found


def render_markdown(rows: list[dict], found: list[tuple[str, bool]], meta: dict) -> str:
    lines = [f"# LLaMA-Factory QLoRA file on the GPU, {meta['date']}", "", f"{meta['machine_line']}.",
             f"Model: random weights, {meta['model']['shape']} shape (Qwen2 architecture), "
             f"{meta['model']['parameters'] / 1e6:.1f}M parameters; data: the LLaMA-Factory fixture folder; "
             f"attention: `flash_attn: {meta['attention']}`; one process (engine local).", "",
             "| gradient_checkpointing | steps | first loss | final loss | tokens/s | median step s | "
             "peak GiB (measured) | estimate GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['gradient_checkpointing']} | failed: {r['error']} | | | | | | |")
            continue
        estimate = f"{r['estimated_memory_bytes'] / 2**30:.2f}" if r["estimated_memory_bytes"] else "-"
        lines.append(f"| {r['gradient_checkpointing']} | {r['global_step']} | {r['losses'][0]:.4f} | "
                     f"{r['final_loss']:.4f} | {r['tokens_per_second']:,.0f} | {r['step_time_median_seconds']} | "
                     f"{r['peak_memory_bytes'] / 2**30:.2f} | {estimate} |")
    lines += ["", "Checks:", ""] + [f"- [{'x' if ok else ' '}] {name}" for name, ok in found]
    lines += ["", "Commands (run in a copy of tests/fixtures/llamafactory):", ""]
    lines += [f"    {r['command']}" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.check_script:
        print("benchmarks/gpu_llamafactory.py needs a CUDA GPU (--check-script checks the script without one)")
        return 2
    work = args.work_dir / args.shape
    info = build_model(work / "model", args.shape)
    shutil.rmtree(work / "lf", ignore_errors=True)
    shutil.copytree(FIXTURES, work / "lf")
    rows = [run_one(work, work / "model", checkpointing, args.check_script) for checkpointing in (True, False)]
    found = checks(rows, info, work / "model", args.check_script)
    meta = {"date": args.date, "machine": machine(), "machine_line": machine_line(machine()), "model": info,
            "attention": attention_kernel(), "command": shlex.join(["python", "benchmarks/gpu_llamafactory.py", *argv])}
    stem = args.out / f"gpu-{args.date}-llamafactory"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows, "checks": dict(found)}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(render_markdown(rows, found, meta))
    print(stem.with_suffix(".md").read_text())
    return 0 if all(ok for _, ok in found) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
