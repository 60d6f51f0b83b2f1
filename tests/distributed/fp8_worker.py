"""Worker for tests/distributed/test_fp8_engines.py: ds_worker.py's tiny LLaMA (every projection 16-aligned) with
torchao's float8 layers, trained under an engine; per-step metrics as JSON.

    python fp8_worker.py --out DIR --reference             one process (LocalEngine), each step's global batch
    torchrun --nproc-per-node 2 fp8_worker.py --out DIR    DeepSpeed ZeRO-3, then FSDP2 with the float8 all-gather

The engines are built directly (as ds_worker.py does): a rank's CLI refuses fp8 without a float8 GPU, while torch
2.13 runs float8 matmuls on the CPU, so the engines' float8 paths are checked here on gloo.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from ds_worker import (  # run as a script: this folder is on sys.path
    Case,
    build_model,
    deepspeed_engine,
    global_batches,
    prepare,
    rank_batches,
    train,
)

from shardtune.engines.base import PrecisionSettings
from shardtune.model.fp8 import apply_float8_training


def float8_model(fsdp_all_gather: bool = False) -> tuple[torch.nn.Module, int]:
    model = build_model("full")
    return model, apply_float8_training(model, fsdp_all_gather).converted


def run_reference(out: Path) -> None:
    from shardtune.engines.local import LocalEngine

    engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
    model, converted = float8_model()
    prepare(engine, model)
    result = {"converted": converted, "metrics": train(engine, global_batches(rank_batches()))}
    (out / "reference.json").write_text(json.dumps(result, indent=2))


def run_engines(out: Path) -> None:
    from shardtune.engines.distributed import init_distributed
    from shardtune.engines.engine_plan import FsdpSettings
    from shardtune.engines.fsdp import FSDPEngine
    from shardtune.launch.env import read_rank_env

    ctx = init_distributed(read_rank_env(), 300)
    batches = rank_batches()[ctx.rank]
    results: dict[str, dict] = {}
    try:
        zero3 = deepspeed_engine(ctx, Case("z3", "full"))
        model, converted = float8_model()
        prepare(zero3, model)
        results["z3"] = {"converted": converted, "metrics": train(zero3, batches)}
        zero3.destroy()
        fsdp = FSDPEngine(FsdpSettings(), PrecisionSettings(), ctx)
        model, converted = float8_model(fsdp_all_gather=True)
        prepare(fsdp, model)
        results["fsdp2_all_gather"] = {"converted": converted, "metrics": train(fsdp, batches),
                                       "precomputes_scales": fsdp.float8_all_gather,
                                       "scales_precomputed": scales_precomputed(fsdp.model)}
        if ctx.rank == 0:
            (out / "engines.json").write_text(json.dumps(results, indent=2))
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def scales_precomputed(model: torch.nn.Module) -> bool:
    """Every float8 weight's local shard carries the scale the FSDP engine computed after the last step."""
    from torchao.float8.float8_linear import Float8Linear

    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    return bool(layers) and all(getattr(m.weight._local_tensor, "_precomputed_scale", None) is not None
                                for m in layers)


def main() -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run_reference(args.out) if args.reference else run_engines(args.out)


if __name__ == "__main__":
    main()
