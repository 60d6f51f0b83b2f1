"""One process, bf16 autocast, LoRA: the frozen base kept fp32 (cast at every call) vs stored in bf16.

    .venv/bin/python benchmarks/lora_frozen_base_cpu.py [--layers 8 --hidden 1024 --intermediate 2816] [--steps 10]

``model/finetuning/lora.py::store_frozen_bases_in`` keeps each plain LoRA layer's frozen base weight in the autocast
dtype (what one process and DDP run with ``bf16: true`` since 2026-11-28). Two copies of one random LLaMA with the same
LoRA adapter (rank 16, every linear layer) train the same batches in turn, one step each, through shardtune's own
step (``train.loop.train_step``, local engine, AdamW): the copy as before (fp32 bases) and the copy with bf16 bases.
Reported: CPU time per step (``time.process_time``, median over ``--steps`` after 2 warm-up steps), the weights'
bytes, the bytes the forward keeps for the backward (autograd's saved tensors, summed over one forward) and the
losses, which must be equal. Results: benchmarks/results/lora-frozen-base-cpu-<rows>x<tokens>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, machine_line

REPO = Path(__file__).resolve().parents[1]


def saved_bytes(model, batch) -> int:
    """Bytes of the tensors one forward saves for the backward (each storage once), the weights themselves not
    counted."""
    import torch

    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:  # a weight saved as it is costs nothing more
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="8")
    parser.add_argument("--hidden", default="1024")
    parser.add_argument("--heads", default="16")
    parser.add_argument("--kv-heads", default="4")
    parser.add_argument("--intermediate", default="2816")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=1, help="rows per micro-batch (2 micro-batches a step)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="lora-base-")) / "model"
    subprocess.run([sys.executable, "-m", "shardtune", "make-tiny-model", "--out", str(folder), "--layers",
                    args.layers, "--hidden", args.hidden, "--heads", args.heads, "--kv-heads", args.kv_heads,
                    "--intermediate", args.intermediate], check=True, capture_output=True)
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.engines.base import PrecisionSettings
    from shardtune.engines.local import LocalEngine
    from shardtune.model.finetuning.apply import apply_finetuning
    from shardtune.model.finetuning.lora import leave_adapter_inputs_to_autocast, store_frozen_bases_in
    from shardtune.model.finetuning.settings import FinetuningSettings
    from shardtune.optim.build import build_optimizer, build_scheduler
    from shardtune.optim.settings import OptimizerSettings
    from shardtune.train.loop import train_step

    torch.manual_seed(0)
    fp32_bases = apply_finetuning(AutoModelForCausalLM.from_pretrained(folder),
                                  FinetuningSettings(finetuning_type="lora", lora_rank=16))
    leave_adapter_inputs_to_autocast(fp32_bases)
    bf16_bases = copy.deepcopy(fp32_bases)
    changed = store_frozen_bases_in(bf16_bases, torch.bfloat16)
    engines = {}
    for name, model in (("fp32 bases", fp32_bases), ("bf16 bases", bf16_bases)):
        engine = LocalEngine(PrecisionSettings(bf16=True), torch.device("cpu"))
        engine.prepare(model, lambda p: build_optimizer(p, OptimizerSettings(optim="adamw_torch", learning_rate=1e-4)),
                       lambda o: build_scheduler(o, "constant", 1000, 0))
        engines[name] = engine
    generator = torch.Generator().manual_seed(0)
    vocab = fp32_bases.config.vocab_size

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(3, vocab, (args.rows, args.tokens), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}

    rows = {name: {"seconds": [], "losses": []} for name in engines}
    for step in range(args.steps + 2):
        window = [batch(), batch()]
        for name, engine in engines.items():  # the same window for both, in turn
            started = time.process_time()
            metrics = train_step(engine, window, 1.0, 0)
            if step >= 2:
                rows[name]["seconds"].append(time.process_time() - started)
            rows[name]["losses"].append(round(float(metrics["loss"]), 6))
    probe = batch()
    result = {"machine": machine(), "layers": int(args.layers), "hidden": int(args.hidden), "base_layers": changed,
              "steps": args.steps, "rows": args.rows, "tokens": args.tokens}
    for name, engine in engines.items():
        model = engine.model
        result[name] = {"step_cpu_seconds_median": round(statistics.median(rows[name]["seconds"]), 4),
                        "weight_bytes": sum(p.nbytes for p in model.parameters()),
                        "saved_for_backward_bytes": saved_bytes(model, probe),
                        "losses": rows[name]["losses"]}
    before, after = result["fp32 bases"], result["bf16 bases"]
    result["same_losses"] = before["losses"] == after["losses"]
    result["step_time_ratio"] = round(before["step_cpu_seconds_median"] / after["step_cpu_seconds_median"], 3)
    out = REPO / "benchmarks" / "results" / f"lora-frozen-base-cpu-{args.rows}x{args.tokens}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(machine_line(result["machine"]))
    for name in engines:
        r = result[name]
        print(f"{name}: {r['step_cpu_seconds_median']:.3f} s CPU per step, "
              f"weights {r['weight_bytes'] / 2**20:.0f} MiB, "
              f"saved for backward {r['saved_for_backward_bytes'] / 2**20:.0f} MiB")
    print(f"step time fp32 bases / bf16 bases: {result['step_time_ratio']}x; same losses: {result['same_losses']}")


if __name__ == "__main__":
    main()
