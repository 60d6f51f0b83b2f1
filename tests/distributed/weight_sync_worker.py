"""Worker for the weight-sync proof (tests/distributed/test_weight_sync.py): trains a tiny LLaMA under a real engine,
streams its weights after every optimizer step into a generator process that keeps its own copy
(train/protocol_generator.py) and checks that copy against the trained weights gathered whole.

    torchrun --standalone --nproc-per-node 2 weight_sync_worker.py --model DIR --out DIR --case zero3-lora

A case is ``<engine>-<finetuning>``: engine ddp, zero3 or fsdp2; finetuning full or lora. Each step the ranks ask the
generator for a different number of prompts' completions (one rank none), then train one optimizer step, then
sync. After each sync rank 0 compares the generator's per-tensor sha256 with those of the trained weights gathered
whole by the engine's own full-state path (ZeRO-3's consolidated state dict, FSDP2's full ``get_model_state_dict``),
for LoRA merged by peft's own ``merge_and_unload`` on a fresh copy, and writes ``<case>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from shardtune.engines.base import Engine, PrecisionSettings
from shardtune.optim.build import OptimizerSettings, build_optimizer, build_scheduler
from shardtune.train.loop import IGNORE_INDEX, Batch, train_step
from shardtune.train.protocol_generator import GeneratorClient, connect_generator, tensor_digest
from shardtune.train.rollout import Sampling
from shardtune.train.weight_sync import sync_weights

STEPS = 3
MICRO_BATCH = 2
SEQ_LEN = 12
BUCKET_BYTES = 512 * 1024  # below the largest layer (the 1 MiB embedding and output layer of the test's model)
# Prompts each rank sends the generator before step s (index s - 1): unequal, and each rank has a step with none.
PROMPTS = ((2, 0), (0, 3), (1, 2))


def build_model(model_dir: str, finetuning: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from shardtune.model.finetuning.apply import apply_finetuning
    from shardtune.model.finetuning.settings import FinetuningSettings

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if finetuning == "lora":
        torch.manual_seed(0)
        model = apply_finetuning(model, FinetuningSettings(finetuning_type="lora", lora_rank=4))
    return model


def make_engine(kind: str, ctx: Any) -> Engine:
    if kind == "ddp":
        from shardtune.engines.ddp import DDPEngine

        return DDPEngine(PrecisionSettings(), ctx)
    if kind == "fsdp2":
        from shardtune.engines.engine_plan import FsdpSettings
        from shardtune.engines.fsdp import FSDPEngine

        return FSDPEngine(FsdpSettings(version=2), PrecisionSettings(), ctx)
    assert kind == "zero3", kind
    from shardtune.engines.deepspeed import DeepSpeedEngine
    from shardtune.engines.deepspeed_checks import build_deepspeed_config
    from shardtune.engines.deepspeed_config import DeepSpeedInputs
    from shardtune.world import WorldLayout

    inputs = DeepSpeedInputs(layout=WorldLayout(1, 2, MICRO_BATCH, 1), max_grad_norm=1.0, bf16=False, fp16=False,
                             hidden_size=128)
    return DeepSpeedEngine(build_deepspeed_config("z3", inputs), PrecisionSettings(), ctx)


def batches(rank: int, vocab: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(3, vocab, (MICRO_BATCH, SEQ_LEN), generator=gen)
        labels = ids.clone()
        labels[:, :3] = IGNORE_INDEX
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def whole_state(engine: Engine, kind: str) -> dict[str, torch.Tensor]:
    """The trained weights gathered whole by the engine's own full-state path (a collective; rank 0's is full)."""
    if kind == "zero3":
        return engine._full_state_dict(adapter_only=False) or {}  # type: ignore[attr-defined]
    if kind == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in engine.unwrapped_model().state_dict().items()}


def expected_digests(model_dir: str, finetuning: str, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """The checkpoint a generator should hold: the whole state loaded into a fresh copy, LoRA merged by peft."""
    model = build_model(model_dir, finetuning)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing[:3], unexpected[:3])
    if finetuning == "lora":
        model = model.merge_and_unload()
    return {name: tensor_digest(t) for name, t in model.state_dict().items()}


def ask_for_rollouts(client: GeneratorClient, count: int, step: int, rank: int) -> int:
    """``count`` prompts' completions from the generator (each rank its own, no collective); tokens received."""
    tokens = 0
    for i in range(count):
        prompt = [5 + rank, 7 + i, 11 + step]
        done = client.generate(prompt, 2, Sampling(max_completion_length=4, seed=step), row=100 * rank + i)
        assert done.ids.shape == (2, 4) and torch.isfinite(done.logps).all()
        tokens += int(done.mask.sum())
    return tokens


def check(engine: Engine, client: GeneratorClient, model_dir: str, kind: str, finetuning: str) -> dict[str, Any]:
    state = whole_state(engine, kind)
    if not engine.is_main:
        return {}
    expected = expected_digests(model_dir, finetuning, state)
    found = client.digest()
    equal = sorted(name for name in expected if found.get(name) == expected[name])
    model_bytes = sum(t.nelement() * t.element_size() for t in state.values())
    return {"names": sorted(expected), "generator_names": sorted(found), "equal": equal, "digests": expected,
            "largest_layer_bytes": largest_layer_bytes(state), "model_bytes": model_bytes}


def largest_layer_bytes(state: dict[str, torch.Tensor]) -> int:
    """The largest layer's bytes in the gathered state: a module's own tensors, a LoRA layer with its adapters."""
    layers: dict[str, int] = {}
    for name, tensor in state.items():
        layer = name.rsplit(".", 1)[0]
        for part in (".base_layer", ".lora_A.default", ".lora_B.default"):
            layer = layer.replace(part, "")
        layers[layer] = layers.get(layer, 0) + tensor.nelement() * tensor.element_size()
    return max(layers.values())


def run_case(ctx: Any, model_dir: str, case: str) -> dict[str, Any]:
    kind, finetuning = case.split("-")
    model = build_model(model_dir, finetuning)
    engine = make_engine(kind, ctx)
    settings = OptimizerSettings(learning_rate=1e-2, weight_decay=0.0)
    engine.prepare(model, lambda params: build_optimizer(params, settings),
                   lambda opt: build_scheduler(opt, "constant", STEPS, 0))
    engine.verify()
    client, process = connect_generator(engine, model_dir, torch.float32, stop_ids=[2], pad_token_id=0)
    receiver = client if engine.is_main else None
    steps: list[dict[str, Any]] = []
    try:
        sync = sync_weights(engine, receiver, BUCKET_BYTES)  # before training: the generator gets the policy's start
        steps.append({"sync": vars(sync), "check": check(engine, client, model_dir, kind, finetuning)})
        for step, window in enumerate(batches(engine.rank, 2048), start=1):
            started = time.perf_counter()
            tokens = ask_for_rollouts(client, PROMPTS[step - 1][engine.rank], step, engine.rank)
            metrics = train_step(engine, [window], 1.0)
            sync = sync_weights(engine, receiver, BUCKET_BYTES)
            steps.append({"sync": vars(sync), "check": check(engine, client, model_dir, kind, finetuning),
                          "loss": float(metrics["loss"]), "rollout_tokens": tokens,
                          "seconds": time.perf_counter() - started})
    finally:
        client.close()
        if process is not None:
            process.stop()
    if hasattr(engine, "destroy"):
        engine.destroy()
    return {"steps": steps, "world_size": engine.world_size, "rank": engine.rank}


def main() -> None:
    from shardtune.engines.distributed import init_distributed
    from shardtune.launch.env import read_rank_env

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", required=True)
    args = parser.parse_args()
    ctx = init_distributed(read_rank_env(), 120)
    try:
        result = run_case(ctx, args.model, args.case)
        rollouts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rollouts, [s.get("rollout_tokens") for s in result["steps"]])
        if torch.distributed.get_rank() == 0:
            result["rollout_tokens_by_rank"] = rollouts
            Path(args.out, f"{args.case}.json").write_text(json.dumps(result, indent=1))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
