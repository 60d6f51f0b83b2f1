"""Worker for the MoE engine tests: trains the tiny Qwen3-MoE with each rank on its own tokens, records which
experts each rank's router chose, and writes per-step metrics as JSON.

    torchrun --standalone --nproc-per-node 2 moe_worker.py --model DIR --out DIR --cases z3_full,fsdp2_lora,...

A case is ``<engine>_<finetuning>``: engine one of ENGINES (DDP, DeepSpeed ZeRO-2/ZeRO-3, FSDP2, FSDP1), or with
expert parallelism ``fsdp2ep<E>`` / ``z<stage>ep<E>`` (DeepSpeed's AutoEP), finetuning ``full`` or ``lora``.
    python moe_worker.py --model DIR --out DIR --reference

The two ranks draw token ids from disjoint halves of the vocabulary, so their routers see different inputs and
choose different experts (counted from the router logits by a forward hook, not assumed). The one-process
reference trains the same micro-batches in the same windows (rank 0's and rank 1's micro-batches side by side,
accumulated), so the LM loss and the router auxiliary loss (a mean over micro-batches) both match exactly.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from shardtune.engines.base import Engine, PrecisionSettings
from shardtune.model.finetuning.apply import apply_finetuning
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.moe import ROUTER_NAMES, router_aux_loss_coef, router_module_names
from shardtune.optim.build import OptimizerSettings, build_optimizer, build_scheduler
from shardtune.train.loop import IGNORE_INDEX, Batch, train_step

WORLD = 2
MICRO_BATCH = 2
ACCUMULATION = 2
STEPS = 3
SEQ_LEN = 16
COEF = 0.1  # the router aux loss coefficient (the tiny model's own is 0.001: too small to see in the loss)
OPTIMIZER = OptimizerSettings(learning_rate=1e-3, weight_decay=0.0)
ENGINES = ("ddp", "z2", "z3", "fsdp2", "fsdp1")


def build_model(model_dir: str, finetuning: str) -> torch.nn.Module:
    """``finetuning``: full, lora (every target: attention, and the fused expert weights as peft's
    target_parameters), attnlora (LoRA on o_proj only), skewfull / skewlora: full / lora with every routed choice
    moved into the first half of the experts (the first expert-parallel rank's), so the other ranks receive none, or
    loopfull: full with the experts computed by transformers' per-expert loop (default: its grouped matmul)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # GPT-OSS refuses sdpa (its attention sinks): eager, as a user must ask for it until attention is chosen per model
    eager = json.loads((Path(model_dir) / "config.json").read_text())["model_type"] == "gpt_oss"
    model = AutoModelForCausalLM.from_pretrained(model_dir, **({"attn_implementation": "eager"} if eager else {}))
    if finetuning.startswith("skew"):
        skew_routing(model)
    if finetuning == "loopfull":  # transformers' per-expert loop instead of its default grouped matmul
        model.set_experts_implementation("eager")
    if finetuning in ("lora", "skewlora"):
        model = apply_finetuning(model, FinetuningSettings(finetuning_type="lora", lora_rank=4))
    elif finetuning == "attnlora":  # LoRA beside experts that stay whole-weight (expert parallelism's LoRA)
        model = apply_finetuning(model, FinetuningSettings(finetuning_type="lora", lora_rank=4,
                                                           lora_target=["o_proj"]))
    return model


def skew_routing(model: torch.nn.Module) -> None:
    """Send every (token, choice) to an expert of the first half (index mod half the experts)."""
    from shardtune.model.moe import EXPERTS_NAME, sparse_moe_blocks

    def first_half(module: torch.nn.Module, args: tuple) -> tuple:
        hidden, index, weights = args
        return hidden, index % (module.num_experts // 2), weights

    for _, block in sparse_moe_blocks(model):
        getattr(block, EXPERTS_NAME).register_forward_pre_hook(first_half)


def skew_autoep_routing(model: torch.nn.Module) -> None:
    """``skew_routing`` for DeepSpeed's AutoEP, which replaces the MoE blocks (and the hook on their experts) with
    its own: each of its routers' choices moved into the first half of the experts, the weights kept."""
    from deepspeed.moe.ep_count import count_tokens_per_expert
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    def first_half(module: torch.nn.Module, _inputs: tuple, output: tuple) -> tuple:
        scores, chosen, _counts = output
        moved = chosen % (module.num_experts // 2)
        return scores, moved, count_tokens_per_expert(moved, module.num_experts)

    hooked = [m.register_forward_hook(first_half) for m in model.modules() if isinstance(m, TokenChoiceTopKRouter)]
    assert hooked, "no AutoEP router in the model"


def weight_fingerprints(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per weight: its norm and its dot product with a fixed random vector (any change of a value shows)."""
    found = {}
    for name, value in sorted(state.items()):
        flat = value.detach().float().flatten()
        probe = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(7))
        found[name] = [flat.norm().item(), flat.dot(probe).item()]
    return found


def rank_batches(vocab: int) -> list[list[Batch]]:
    """batches[rank][i]; rank r's token ids come from its own half of the vocabulary."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    half = vocab // WORLD
    for rank in range(WORLD):
        batches = []
        for _ in range(STEPS * ACCUMULATION):
            ids = torch.randint(rank * half, (rank + 1) * half, (MICRO_BATCH, SEQ_LEN), generator=gen)
            labels = ids.clone()
            labels[:, : int(torch.randint(1, 6, (1,), generator=gen))] = IGNORE_INDEX
            batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        out.append(batches)
    return out


def count_expert_choices(model: torch.nn.Module, top_k: int, experts: int) -> torch.Tensor:
    """A tensor that forward hooks on every router fill with how often each expert is among the top-k."""
    counts = torch.zeros(experts, dtype=torch.long)
    routers = router_module_names(model)
    modules = dict(model.named_modules())

    def hook(_module: torch.nn.Module, _inputs: object, output: object) -> None:
        logits = output[0] if isinstance(output, tuple) else output  # (tokens, experts) router logits
        chosen = logits.detach().float().topk(top_k, dim=-1).indices.flatten()
        counts.add_(torch.bincount(chosen, minlength=experts))

    for name in routers:
        modules[name].register_forward_hook(hook)
    assert routers and all(n.rsplit(".", 1)[-1] in ROUTER_NAMES for n in routers)
    return counts


def prepare(engine: Engine, model: torch.nn.Module) -> None:
    engine.prepare(model, lambda params: build_optimizer(params, OPTIMIZER),
                   lambda opt: build_scheduler(opt, "constant", STEPS, 0))
    engine.verify()


def train(engine: Engine, windows: list[list[Batch]], config: object) -> list[dict[str, float]]:
    """Train with the router aux loss at COEF (DeepSeek-V3 has none: its routing bias balances the experts)."""
    engine.model.train()
    coef = router_aux_loss_coef(config, COEF)
    return [train_step(engine, window, 1.0, router_aux_loss_coef=coef) for window in windows]


def expert_count(config: object) -> int:
    return next(getattr(config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                if hasattr(config, key))


def run_reference(model_dir: str, out: Path) -> None:
    from shardtune.engines.local import LocalEngine

    results = {}
    for finetuning in ("full", "lora", "attnlora", "skewfull", "skewlora", "loopfull"):
        model = build_model(model_dir, finetuning)
        per_rank = rank_batches(model.config.vocab_size)
        # one window per step: every micro-batch of every rank, each its own forward (as on two ranks)
        windows = [[per_rank[r][s * ACCUMULATION + i] for i in range(ACCUMULATION) for r in range(WORLD)]
                   for s in range(STEPS)]
        engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
        prepare(engine, model)
        results[finetuning] = train(engine, windows, model.config)
        results[f"{finetuning}:weights"] = weight_fingerprints(model.state_dict())
    (out / "reference.json").write_text(json.dumps(results, indent=2))


def make_engine(kind: str, ctx: object, model_dir: str = "") -> Engine:
    if kind == "ddp":
        from shardtune.engines.ddp import DDPEngine

        return DDPEngine(PrecisionSettings(), ctx)
    if kind.startswith("fsdp2ep"):  # FSDP2 with expert parallelism: fsdp2ep<E>
        from shardtune.engines.engine_plan import FsdpSettings
        from shardtune.engines.fsdp import FSDPEngine

        return FSDPEngine(FsdpSettings(version=2), PrecisionSettings(), ctx, expert_parallel=int(kind[7:]))
    if kind in ("fsdp2", "fsdp1"):
        from shardtune.engines.engine_plan import FsdpSettings
        from shardtune.engines.fsdp import FSDPEngine

        return FSDPEngine(FsdpSettings(version=int(kind[-1])), PrecisionSettings(), ctx)
    zero, _, ep = kind.partition("ep")  # z<stage>, or z<stage>ep<E>: DeepSpeed's AutoEP over E ranks
    assert zero in ("z1", "z2", "z3"), kind
    from shardtune.engines.deepspeed_autoep import with_autoep
    from shardtune.engines.deepspeed_checks import build_deepspeed_config
    from shardtune.engines.deepspeed_config import DeepSpeedInputs
    from shardtune.engines.deepspeed_ep import DeepSpeedEngineEP
    from shardtune.world import WorldLayout

    inputs = DeepSpeedInputs(layout=WorldLayout(1, WORLD, MICRO_BATCH, ACCUMULATION), max_grad_norm=1.0,
                             bf16=False, fp16=False, hidden_size=64)
    config = build_deepspeed_config(zero, inputs)
    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"] if ep else None
    return DeepSpeedEngineEP(with_autoep(config, int(ep or 1), model_type), PrecisionSettings(), ctx)


def run_case(ctx: object, model_dir: str, name: str) -> dict:
    kind, finetuning = name.split("_")
    rank = torch.distributed.get_rank()
    model = build_model(model_dir, finetuning)
    config = model.config
    counts = count_expert_choices(model, config.num_experts_per_tok, expert_count(config))
    batches = rank_batches(config.vocab_size)[rank]
    windows = [batches[s * ACCUMULATION:(s + 1) * ACCUMULATION] for s in range(STEPS)]
    engine = make_engine(kind, ctx, model_dir)
    prepare(engine, model)
    if finetuning.startswith("skew") and kind.startswith("z") and "ep" in kind:
        skew_autoep_routing(engine.model)
    result: dict = {"metrics": train(engine, windows, config), "expert_shards": expert_shards(engine.model),
                    "z3_leaves": z3_leaves(engine.model)}
    if finetuning in ("full", "skewfull", "loopfull") and (kind.startswith("fsdp2") or "ep" in kind):
        state = engine.full_state_dict()  # DeepSpeed's AutoEP: under transformers' names, on rank 0 only
        if state is not None:
            result["weights"] = weight_fingerprints(state)
    report = engine.expert_parallel_report(STEPS)
    if report is not None:
        result["expert_parallel"] = report
    everyone = [torch.zeros_like(counts) for _ in range(WORLD)]
    torch.distributed.all_gather(everyone, counts)
    result["expert_counts"] = [c.tolist() for c in everyone]
    if hasattr(engine, "destroy"):
        engine.destroy()
    torch.distributed.barrier()
    return result


def expert_shards(model: torch.nn.Module) -> dict[str, list[list[int]]]:
    """Each fused expert weight's (global shape, this rank's local shape) under FSDP2 (DTensor), else empty."""
    found = {}
    for name, param in model.named_parameters():
        if ".experts." in name and name.endswith(("gate_up_proj", "down_proj")) and hasattr(param, "to_local"):
            found[name] = [list(param.shape), list(param.to_local().shape)]
    return found


def z3_leaves(model: torch.nn.Module) -> list[str]:
    """Class names of the modules DeepSpeed ZeRO-3 treats as leaves (gathered whole on entry)."""
    from deepspeed.utils import z3_leaf_module

    return sorted({type(m).__name__ for m in model.modules() if z3_leaf_module(m)})


def run_distributed(model_dir: str, out: Path, names: list[str]) -> None:
    from shardtune.engines.distributed import init_distributed
    from shardtune.launch.env import read_rank_env

    ctx = init_distributed(read_rank_env(), 300)
    try:
        for name in names:
            result = run_case(ctx, model_dir, name)
            if torch.distributed.get_rank() == 0:
                (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def main() -> None:
    global WORLD
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--world", type=int, default=WORLD, help="ranks (the reference: ranks it stands for)")
    args = parser.parse_args()
    WORLD = args.world
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.reference:
        run_reference(args.model, out)
    else:
        run_distributed(args.model, out, [c for c in args.cases.split(",") if c])


if __name__ == "__main__":
    main()
