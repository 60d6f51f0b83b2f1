"""Worker for the DeepSpeed engine tests: trains a tiny random LLaMA and writes per-step losses as JSON.

    torchrun --standalone --nproc-per-node 2 ds_worker.py --out DIR --cases z0,z2_lora,...
    python ds_worker.py --out DIR --reference

Under torchrun each case trains with DeepSpeedEngine (one process group, one engine after another); with
--reference one process trains the same global batches with LocalEngine (each rank's micro-batches
concatenated). Both use shardtune's train_step, so the test compares the engines, not two loops.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from shardtune.engines.base import Engine, PrecisionSettings
from shardtune.engines.deepspeed import DeepSpeedEngine
from shardtune.engines.distributed import DistContext
from shardtune.model.finetuning.apply import apply_finetuning
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.optim.build import OptimizerSettings, build_optimizer, build_scheduler
from shardtune.train.loop import IGNORE_INDEX, Batch, accumulation_windows, token_loss_sum, train_step

WORLD = 2
MICRO_BATCH = 2
ACCUMULATION = 2
MICRO_BATCHES = 7  # windows of 2, 2, 2 and 1: the last window is short, as at the end of an epoch
STEPS = 4
SEQ_LEN = 16
VOCAB = 256
HIDDEN = 64
MAX_GRAD_NORM = 1.0
RESUME_AFTER = 2  # resume cases save after this many steps and replay the rest in a fresh engine
OPTIMIZER = OptimizerSettings(learning_rate=1e-3, weight_decay=0.01)


@dataclass(frozen=True)
class Case:
    preset: str
    finetuning: str
    resume: bool = False
    gather_on_save: bool = True  # False: ZeRO-3's final save is written module by module


CASES = {
    "z0": Case("z0", "full"),
    "z1": Case("z1", "full"),
    "z2": Case("z2", "full"),
    "z3": Case("z3", "full", resume=True),
    "z2_offload": Case("z2_offload", "full"),
    "z3_offload": Case("z3_offload", "full"),
    "z3_offload_streamed": Case("z3_offload", "full", gather_on_save=False),
    "z2_lora": Case("z2", "lora", resume=True),
    "z3_lora": Case("z3", "lora", resume=True),
}


def build_model(finetuning: str) -> torch.nn.Module:
    """The same random weights (and LoRA init) in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    if finetuning == "lora":
        model = apply_finetuning(model, FinetuningSettings(finetuning_type="lora", lora_rank=4))
    return model


def rank_batches() -> list[list[Batch]]:
    """batches[rank][i]: seeded token ids; labels mask a prompt prefix and random positions (uneven counts)."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(WORLD):
        batches = []
        for _ in range(MICRO_BATCHES):
            ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN), generator=gen)
            labels = ids.clone()
            labels[:, : int(torch.randint(1, 6, (1,), generator=gen))] = IGNORE_INDEX
            labels[torch.rand(ids.shape, generator=gen) < 0.2] = IGNORE_INDEX
            batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        out.append(batches)
    return out


def global_batches(per_rank: list[list[Batch]]) -> list[Batch]:
    return [{k: torch.cat([per_rank[r][i][k] for r in range(WORLD)]) for k in per_rank[0][i]}
            for i in range(MICRO_BATCHES)]


def eval_batch() -> Batch:
    gen = torch.Generator().manual_seed(99)
    ids = torch.randint(0, VOCAB, (4, SEQ_LEN), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batch: Batch) -> float:
    model.eval()
    loss, count = token_loss_sum(model, batch)
    model.train()
    return float(loss / count)


def prepare(engine: Engine, model: torch.nn.Module) -> None:
    engine.prepare(model, lambda params: build_optimizer(params, OPTIMIZER),
                   lambda opt: build_scheduler(opt, "constant", STEPS, 0))
    engine.verify()


def train(engine: Engine, batches: list[Batch], first: int = 0, last: int = STEPS) -> list[dict[str, float]]:
    engine.model.train()
    windows = list(accumulation_windows(batches, ACCUMULATION))
    return [train_step(engine, window, MAX_GRAD_NORM) for window in windows[first:last]]


def run_reference(out: Path) -> None:
    from shardtune.engines.local import LocalEngine

    results = {}
    for finetuning in ("full", "lora"):
        engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
        prepare(engine, build_model(finetuning))
        metrics = train(engine, global_batches(rank_batches()))
        results[finetuning] = {"metrics": metrics, "eval_loss": mean_loss(engine.model, eval_batch())}
    (out / "reference.json").write_text(json.dumps(results, indent=2))


def run_deepspeed(out: Path, names: list[str]) -> None:
    from shardtune.engines.distributed import init_distributed
    from shardtune.launch.env import read_rank_env

    ctx = init_distributed(read_rank_env(), 300)
    try:
        for name in names:
            result = run_case(ctx, CASES[name], out / name)
            if ctx.rank == 0:
                (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def deepspeed_engine(ctx: DistContext, case: Case) -> DeepSpeedEngine:
    from shardtune.engines.deepspeed_checks import build_deepspeed_config
    from shardtune.engines.deepspeed_config import DeepSpeedInputs
    from shardtune.world import WorldLayout

    inputs = DeepSpeedInputs(layout=WorldLayout(1, ctx.world_size, MICRO_BATCH, ACCUMULATION),
                             max_grad_norm=MAX_GRAD_NORM, bf16=False, fp16=False,
                             hidden_size=HIDDEN)
    config = build_deepspeed_config(case.preset, inputs)
    if not case.gather_on_save:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    return DeepSpeedEngine(config, PrecisionSettings(), ctx)


def run_case(ctx: DistContext, case: Case, case_dir: Path) -> dict:
    batches = rank_batches()[ctx.rank]
    engine = deepspeed_engine(ctx, case)
    prepare(engine, build_model(case.finetuning))
    result: dict = {"zero_stage": engine.zero_stage, "optimizer": type(engine.ds.basic_optimizer).__name__}
    metrics = train(engine, batches, 0, RESUME_AFTER if case.resume else STEPS)
    if case.resume:
        save_state(engine, ctx, case_dir / "checkpoint")
        metrics += train(engine, batches, RESUME_AFTER, STEPS)
    result["metrics"] = metrics
    result["lr"] = engine.current_lr()
    engine.save_model(case_dir / "model")
    engine.destroy()
    if case.resume:
        result["resumed_metrics"] = resume(ctx, case, case_dir / "checkpoint", batches)
    if ctx.rank == 0:
        result["saved_files"] = sorted(p.name for p in (case_dir / "model").iterdir())
        result["reload_eval_loss"] = reload_eval_loss(case, case_dir / "model")
    torch.distributed.barrier()
    return result


def save_state(engine: Engine, ctx: DistContext, ckpt: Path) -> None:
    if ctx.rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir(parents=True)
    torch.distributed.barrier()
    engine.save_state(ckpt)
    torch.distributed.barrier()


def resume(ctx: DistContext, case: Case, ckpt: Path, batches: list[Batch]) -> list[dict[str, float]]:
    """A fresh engine (weights re-initialised) that loads the checkpoint and trains the remaining steps."""
    engine = deepspeed_engine(ctx, case)
    torch.manual_seed(7)  # make sure nothing but the checkpoint can restore the trained weights
    model = build_model(case.finetuning)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.02)
    prepare(engine, model)
    engine.load_state(ckpt)
    metrics = train(engine, batches, RESUME_AFTER, STEPS)
    engine.destroy()
    return metrics


def reload_eval_loss(case: Case, model_dir: Path) -> float:
    """Loss of the saved weights, loaded by transformers (peft for an adapter), on the fixed eval batch."""
    if case.finetuning == "lora":
        from peft import PeftModel

        model = PeftModel.from_pretrained(build_model("full"), str(model_dir))
    else:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(str(model_dir))
    return mean_loss(model, eval_batch())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if args.reference:
        run_reference(args.out)
    else:
        run_deepspeed(args.out, [c for c in args.cases.split(",") if c])


if __name__ == "__main__":
    main()
