"""Packed rows on the CPU: the dense block mask under sdpa against ``attn_implementation: varlen`` (SDPA's causal
kernel per sample, model/varlen.py), one process, full fine-tuning.

    .venv/bin/python benchmarks/varlen_cpu.py [--tokens 1024 --rows 2 --steps 5 --bf16]

A random LLaMA (``--layers`` x ``--hidden``, GQA) trains the same packed rows under both kernels, interleaved, one
forward and backward each, through the collator each kernel gets (the ``[B, 1, L, L]`` mask, or the offsets).
Samples are drawn 40-700 tokens long (multi-turn chat lengths) and packed into rows of ``--tokens``. Reported: CPU
time per forward+backward (``time.process_time``, median over ``--steps`` after one warm-up), the bytes the forward
keeps for the backward (autograd's saved tensors, each storage once), the batch's mask bytes, and the losses, which
must agree. Results: benchmarks/results/varlen-cpu-<rows>x<tokens>-<precision>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

from common import machine, machine_line

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def packed_rows(rows: int, tokens: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    import torch

    from shardtune.data.packing import pack_row

    generator = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(rows):
        samples, room = [], tokens
        while room > 40:
            n = min(int(torch.randint(40, 700, (1,), generator=generator)), room)
            samples.append(torch.randint(3, vocab, (n,), generator=generator).tolist())
            room -= n
        found.append(pack_row(samples, samples))
    return found


def saved_bytes(model, inputs: dict, autocast: contextlib.AbstractContextManager) -> int:
    import torch

    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(**inputs, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 without it)")
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.data.collator import DataCollator
    from shardtune.model.varlen import register_varlen

    register_varlen()
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.tokens)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").train()

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()

    def inputs(kernel: str, step: int) -> dict:
        batch = DataCollator(0, attn_implementation=kernel)(packed_rows(args.rows, args.tokens, 32000, step))
        return {k: v for k, v in batch.items() if k != "num_tokens"}

    seconds: dict[str, list[float]] = {"sdpa": [], "varlen": []}
    losses: dict[str, list[float]] = {"sdpa": [], "varlen": []}
    for step in range(args.steps + 1):
        for kernel in seconds:  # the same rows under both, in turn
            model.set_attn_implementation(kernel)
            batch = inputs(kernel, step)
            started = time.process_time()
            with autocast():
                loss = model(**batch, use_cache=False).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            if step:
                seconds[kernel].append(time.process_time() - started)
            losses[kernel].append(round(float(loss), 5))
    result = {"machine": machine(), "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
              "kv_heads": args.kv_heads, "rows": args.rows, "tokens": args.tokens,
              "precision": "bf16" if args.bf16 else "fp32", "steps": args.steps,
              "samples_per_row": [len(set(r["segment_ids"])) for r in packed_rows(args.rows, args.tokens, 32000, 0)]}
    for kernel in seconds:
        model.set_attn_implementation(kernel)
        batch = inputs(kernel, 0)
        mask = batch.get("attention_mask")
        result[kernel] = {"cpu_seconds_median": round(statistics.median(seconds[kernel]), 3),
                          "saved_for_backward_bytes": saved_bytes(model, batch, autocast()),
                          "mask_bytes": mask.nbytes if isinstance(mask, torch.Tensor) else 0,
                          "losses": losses[kernel]}
    dense, varlen = result["sdpa"], result["varlen"]
    result["losses_agree"] = all(abs(a - b) <= 1e-2 * abs(a) for a, b in zip(dense["losses"], varlen["losses"],
                                                                             strict=True))
    result["time_dense_over_varlen"] = round(dense["cpu_seconds_median"] / varlen["cpu_seconds_median"], 3)
    result["saved_dense_over_varlen"] = round(dense["saved_for_backward_bytes"] / varlen["saved_for_backward_bytes"],
                                              3)
    name = f"varlen-cpu-{args.rows}x{args.tokens}-{result['precision']}.json"
    (REPO / "benchmarks" / "results" / name).write_text(json.dumps(result, indent=1) + "\n")
    print(machine_line(result["machine"]))
    for kernel in seconds:
        r = result[kernel]
        print(f"{kernel}: {r['cpu_seconds_median']:.3f} s CPU per forward+backward, saved for backward "
              f"{r['saved_for_backward_bytes'] / 2**20:.0f} MiB, mask {r['mask_bytes'] / 2**20:.1f} MiB")
    print(f"dense / varlen: time {result['time_dense_over_varlen']}x, saved {result['saved_dense_over_varlen']}x; "
          f"losses agree: {result['losses_agree']} ({dense['losses']} / {varlen['losses']})")


if __name__ == "__main__":
    main()
