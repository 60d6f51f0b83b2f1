"""CPU time of one LoRA training step (local engine, one process) for loss_chunk_size values.

    .venv/bin/python benchmarks/step_cpu.py [MODEL_DIR] [--chunks 1024,0] [--steps 15]

The model is a folder (default: a tiny LLaMA built with ``shardtune make-tiny-model`` into /tmp); the window is two
micro-batches of 4 rows x 200 tokens, the first 60 of each row masked as a prompt; AdamW, LoRA rank 16 on every
linear layer. Reported: ``time.process_time`` per step (the work done; the wall time of this shared machine varies
with other processes), the mean over ``--steps`` after 2 warm-up steps, each chunk size in turn. To compare two
versions of shardtune, run it from each checkout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", type=Path, default=Path("/tmp/shardtune-step-cpu/tiny"))
    parser.add_argument("--chunks", default="1024,0")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "shardtune.cli", "make-tiny-model", "--out", str(args.model)], check=True)
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.engines.base import PrecisionSettings
    from shardtune.engines.local import LocalEngine
    from shardtune.model.finetuning.apply import apply_finetuning
    from shardtune.model.finetuning.settings import FinetuningSettings
    from shardtune.optim.build import build_optimizer, build_scheduler
    from shardtune.optim.settings import OptimizerSettings
    from shardtune.train.loop import train_step

    torch.manual_seed(0)
    model = apply_finetuning(AutoModelForCausalLM.from_pretrained(args.model),
                             FinetuningSettings(finetuning_type="lora", lora_rank=16))
    engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
    engine.prepare(model, lambda p: build_optimizer(p, OptimizerSettings(optim="adamw_torch", learning_rate=1e-3)),
                   lambda o: build_scheduler(o, "constant", 1000, 0))
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(3, vocab, (4, 200), generator=generator)
        labels = ids.clone()
        labels[:, :60] = -100
        return {"input_ids": ids, "labels": labels}

    window = [batch(), batch()]
    for chunk in (int(c) for c in args.chunks.split(",")):
        for _ in range(2):
            train_step(engine, window, 1.0, chunk)
        started = time.process_time()
        for _ in range(args.steps):
            train_step(engine, window, 1.0, chunk)
        print(f"loss_chunk_size {chunk}: {(time.process_time() - started) / args.steps * 1000:.1f} ms CPU per step",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
