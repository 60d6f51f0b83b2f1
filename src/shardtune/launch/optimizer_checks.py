"""LLaMA-Factory's optimizer replacements, checked on the launching host: which keys go together, which packages
they need; the engine rules (which engines can run them) are in engines.spec."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from shardtune.config.schema import TrainConfig
from shardtune.optim.settings import layerwise_key

# The package each LLaMA-Factory replacement is used through (Muon is torch's own).
OPTIMIZER_PACKAGES = {"use_galore": ("galore_torch", "galore-torch"), "use_apollo": ("apollo_torch", "apollo-torch"),
                      "use_adam_mini": ("adam_mini", "adam-mini"), "use_badam": ("badam", "badam")}


def optimizer_key_problems(c: TrainConfig) -> list[str]:
    """LLaMA-Factory's optimizer replacements: one at a time, their packages present, their optim known;
    engine rules are in engines.spec.whole_weight_optimizer_problems."""
    switches = {"use_muon": c.use_muon, "use_adam_mini": c.use_adam_mini, "use_galore": c.use_galore,
                "use_apollo": c.use_apollo, "use_badam": c.use_badam,
                "loraplus_lr_ratio": c.loraplus_lr_ratio is not None}
    on = [key for key, value in switches.items() if value]
    problems = []
    if len(on) > 1:
        problems.append(f"{' and '.join(on)} each replace the optimizer; choose one")
    for key in on:
        module, package = OPTIMIZER_PACKAGES.get(key, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            problems.append(f"{key} (true) needs the {package} package, which is not installed: pip install {package}")
    if c.use_galore and c.optim not in ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "adafactor"):
        problems.append(f"use_galore (true) with optim ({c.optim}): GaLore has adamw_torch, adamw_8bit, adafactor")
    if c.use_apollo and c.optim not in ("adamw_torch", "adamw_torch_fused"):
        problems.append(f"use_apollo (true) with optim ({c.optim}): APOLLO is an AdamW; use optim: adamw_torch")
    if c.use_adam_mini and c.finetuning_type in ("lora", "oft"):
        # Found by the schema fuzzer: the package's step failed with "shape '[-1, 1024]' is invalid for input of
        # size 512" on the tiny LLaMA's LoRA.
        problems.append(f"use_adam_mini (true) with finetuning_type ({c.finetuning_type}): Adam-mini splits each "
                        "weight it finds by name (q_proj, k_proj, ...) into attention heads, and an adapter's "
                        "matrices under those names have no head layout; use finetuning_type: full or freeze, or "
                        "remove use_adam_mini")
    for key in ("use_muon", "use_adam_mini"):
        if switches[key] and c.optim not in ("adamw_torch", "adamw_torch_fused"):
            problems.append(f"{key} (true) with optim ({c.optim}): it replaces the optimizer; use optim: adamw_torch")
    for key, value in (("galore_target", c.galore_target), ("apollo_target", c.apollo_target)):
        if "all" in value and len(value) > 1:
            problems.append(f"{key} ({','.join(value)}): 'all' cannot be combined with module names")
    return problems + layerwise_problems(c) + badam_problems(c)


def layerwise_problems(c: TrainConfig) -> list[str]:
    """Layer-wise steps happen inside each backward (optim/layerwise.py): no accumulation, no loss scaling.
    More than one process is the engine records' rule (engines.spec.one_process_optimizer_problems)."""
    key = layerwise_key(c)
    if key is None:
        return []
    problems = []
    if c.gradient_accumulation_steps > 1:
        problems.append(f"{key} (true) with gradient_accumulation_steps ({c.gradient_accumulation_steps}): each "
                        "weight steps inside every backward, so gradients cannot add up over micro-batches (as in "
                        "LLaMA-Factory); set gradient_accumulation_steps: 1 and raise per_device_train_batch_size")
    if c.fp16:
        problems.append(f"{key} (true) with fp16 (true): each weight would step on its loss-scaled gradient inside "
                        "backward, before the scaler could unscale it or skip an overflowing step; use bf16: true")
    return problems


def badam_problems(c: TrainConfig) -> list[str]:
    """BAdam (optim/badam.py) trains whole decoder layers of a full fine-tune with an AdamW, one block at a time.
    More than one process is the engine records' rule; a launcher's single rank is ``badam_launch_problems``."""
    if not c.use_badam:
        return []
    problems = []
    if c.badam_mode == "ratio":
        problems.append("badam_mode (ratio): the ratio mode (sparse updates of a share of each weight through "
                        "gradient hooks) is not supported; use badam_mode: layer")
    if c.finetuning_type != "full":
        problems.append(f"use_badam (true) with finetuning_type ({c.finetuning_type}): BAdam itself chooses which "
                        "layers train, block by block, over the whole model (LLaMA-Factory refuses it with LoRA "
                        "too); use finetuning_type: full")
    if c.optim not in ("adamw_torch", "adamw_torch_fused"):
        problems.append(f"use_badam (true) with optim ({c.optim}): BAdam steps an AdamW over the active block; use "
                        "optim: adamw_torch or adamw_torch_fused")
    if c.badam_switch_interval == 0:
        problems.append("badam_switch_interval (0): give the steps per block (1 or more), or -1 to never switch")
    if c.gradient_checkpointing and (c.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
        problems.append("use_badam (true) with gradient_checkpointing_kwargs.use_reentrant (true): reentrant "
                        "checkpointing gives no gradient to a layer whose inputs need none, which the frozen layers "
                        "before the active block make so; leave use_reentrant false (the default)")
    return problems


def badam_launch_problems(c: TrainConfig, force_torchrun: bool) -> list[str]:
    """One process under torchrun (FORCE_TORCHRUN) is DDP of one rank, which registers the trainable weights once."""
    if not (c.use_badam and force_torchrun):
        return []
    return ["use_badam (true) with FORCE_TORCHRUN (1): DDP registers the trainable weights once, at set-up, and BAdam "
            "changes them at every block switch; run without FORCE_TORCHRUN (one process, in-process)"]


def badam_layer_problems(c: TrainConfig) -> list[str]:
    """BAdam's blocks are the ``layers.N.`` of the weight names (its package's rule): a checkpoint whose files hold
    none (GPT-2's ``h.N.``) gives it nothing to train, said here from the files' headers as the rank would."""
    from shardtune.model.weight_names import tensor_names

    if not c.use_badam or not c.model_name_or_path:
        return []
    names = tensor_names(Path(c.model_name_or_path))
    if names is None or any(re.search(r"layers\.\d+\.", name) for name in names):
        return []
    return ["use_badam (true): no weight name of the checkpoint holds 'layers.N.', so BAdam finds no decoder layers "
            "to train block by block; use finetuning_type: full without BAdam for this model"]
