"""Optimizer and learning-rate schedule from the Hugging Face names users already write."""

from __future__ import annotations

import math
from functools import partial

import torch

from shardtune.config.schema import BITSANDBYTES_OPTIMIZERS
from shardtune.errors import ConfigError
from shardtune.model.finetuning.targets import linear_module_names
from shardtune.optim import replacements as optimizers
from shardtune.optim.layerwise import build_layerwise
from shardtune.optim.settings import OptimizerSettings

__all__ = ["OptimizerSettings", "build_optimizer", "build_scheduler", "loraplus_groups", "parameter_names",
           "split_decay_groups"]


def split_decay_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Biases and norm weights (1-D tensors) get no weight decay, as in the HF Trainer."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def loraplus_groups(params: list[torch.nn.Parameter], names: dict[int, str], s: OptimizerSettings) -> list[dict]:
    """LoRA+ (as LLaMA-Factory builds it): lora_B matrices and 1-D adapter weights (DoRA magnitudes, biases) learn
    at ``learning_rate x loraplus_lr_ratio``, lora_embedding_B at ``loraplus_lr_embedding``, the rest (lora_A,
    additional_target modules) at ``learning_rate``. Weight decay follows ``split_decay_groups`` (none on 1-D)."""
    assert s.loraplus_lr_ratio is not None
    by_rate: dict[float, list[torch.nn.Parameter]] = {}
    for param in params:
        name = names.get(id(param))
        if name is None:
            raise ConfigError("loraplus_lr_ratio: the engine renamed the trainable parameters (FSDP1 flat parameters);"
                              " use fsdp_version: 2 or use_orig_params: true")
        if "lora_embedding_B" in name:
            rate = s.loraplus_lr_embedding
        elif "lora_B" in name or param.ndim == 1:
            rate = s.learning_rate * s.loraplus_lr_ratio
        else:
            rate = s.learning_rate
        by_rate.setdefault(rate, []).append(param)
    return [{**group, "lr": rate} for rate, members in by_rate.items()
            for group in split_decay_groups(members, s.weight_decay)]


def build_optimizer(params: list[torch.nn.Parameter], s: OptimizerSettings,
                    names: dict[int, str] | None = None, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """The optimizer over ``params``; ``names`` (id -> parameter name) is needed by LoRA+ to find lora_B, ``model``
    (unwrapped) by the LLaMA-Factory replacements (Muon, GaLore, APOLLO, Adam-mini)."""
    if not params:
        raise ConfigError("no trainable parameters: check finetuning_type and lora_target/freeze settings")
    if s.extra.kind is not None:
        assert model is not None, "the optimizer replacements select parameters by module"
        return build_extra_optimizer(params, s, model)
    if s.loraplus_lr_ratio is not None:
        groups = loraplus_groups(params, names or {}, s)
    else:
        groups = split_decay_groups(params, s.weight_decay)
    betas = (s.adam_beta1, s.adam_beta2)
    if s.optim in ("adamw_torch", "adamw_torch_fused"):
        return torch.optim.AdamW(groups, lr=s.learning_rate, betas=betas, eps=s.adam_epsilon,
                                 fused=s.optim == "adamw_torch_fused" or fused_adamw_fits(params))
    if s.optim == "sgd":
        return torch.optim.SGD(groups, lr=s.learning_rate)
    if s.optim == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=s.learning_rate, scale_parameter=False, relative_step=False)
    if s.optim in BITSANDBYTES_OPTIMIZERS:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError(f"optim ({s.optim}) needs bitsandbytes: pip install bitsandbytes") from None
        # Paged: the state lives in CUDA unified memory, moved to CPU memory under pressure; on a CPU bitsandbytes
        # keeps it unpaged (it says so once).
        optimizer_class = getattr(bnb.optim, BITSANDBYTES_OPTIMIZERS[s.optim])
        return optimizer_class(groups, lr=s.learning_rate, betas=betas, eps=s.adam_epsilon)
    raise ConfigError(f"optim: unknown optimizer '{s.optim}'")



def fused_adamw_fits(params: list[torch.nn.Parameter]) -> bool:
    """adamw_torch (the non-fused name) still takes torch's fused kernel where every parameter is a floating-point
    CUDA tensor (FSDP2's DTensors included): one kernel per step for all parameters instead of a dozen element-wise
    launches per tensor. It computes the same update (the kernel tests in tests/gpu compare them); on the CPU
    adamw_torch keeps torch's per-tensor loop, as the HF Trainer does for that name. The default, adamw_torch_fused,
    is fused on every device (the CPU kernel agrees with the loop to 1 ulp per step)."""
    return bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)


def build_extra_optimizer(params: list[torch.nn.Parameter], s: OptimizerSettings,
                          model: torch.nn.Module) -> torch.optim.Optimizer:
    """Muon, GaLore, APOLLO, Adam-mini or BAdam over ``params``, their parameter groups chosen as LLaMA-Factory
    does."""
    wanted = {id(p) for p in params}
    named = [(name, p) for name, p in model.named_parameters() if id(p) in wanted]
    betas, extra = (s.adam_beta1, s.adam_beta2), s.extra
    if extra.kind == "badam":
        from shardtune.optim.badam import build_badam  # the optional badam package, imported only when asked for

        return build_badam(named, s)
    if extra.kind == "muon":
        return optimizers.build_muon(named, s.learning_rate, s.weight_decay, betas, s.adam_epsilon)
    if extra.kind == "adam_mini":
        return optimizers.build_adam_mini(named, getattr(model, "config", None), s.learning_rate, s.weight_decay,
                                          betas, s.adam_epsilon)
    projected = optimizers.projected_names(named, model, extra.target, linear_module_names(model))
    if not projected:
        raise ConfigError(f"{extra.kind}_target ({','.join(extra.target)}): no trainable Linear weight matches; "
                          f"use 'all' or names such as {', '.join(linear_module_names(model)[:4])}")
    optimizers.register_safe_state_types()
    if extra.kind == "galore":
        groups = optimizers.projection_groups(named, projected, s.weight_decay, optimizers.galore_settings(extra))
        build = partial(optimizers.build_galore, optim=s.optim, lr=s.learning_rate, betas=betas, eps=s.adam_epsilon)
    else:
        groups = optimizers.projection_groups(named, projected, s.weight_decay, optimizers.apollo_settings(extra))
        build = partial(optimizers.build_apollo, lr=s.learning_rate, betas=betas, eps=s.adam_epsilon)
    if extra.layerwise:
        # APOLLO seeds each weight's random projection with its position in the optimizer (state "seed").
        return build_layerwise(groups, build, seed_key="seed" if extra.kind == "apollo" else None)
    return build(groups)


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """id -> name of every parameter of ``model`` as it is now (after an engine sharded it in place)."""
    return {id(p): name for name, p in model.named_parameters()}


def warmup_steps_for(total_steps: int, warmup_steps: int, warmup_ratio: float) -> int:
    return warmup_steps if warmup_steps > 0 else math.ceil(total_steps * warmup_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, name: str, total_steps: int, warmup_steps: int):
    from transformers import get_scheduler

    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
