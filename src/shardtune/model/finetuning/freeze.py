"""Freeze tuning: only the chosen decoder layers train (the last N; with LLaMA-Pro the blocks its expansion added),
and in them only ``freeze_trainable_modules``; a reward model's score layer trains too."""

from __future__ import annotations

import re
from typing import Any

from shardtune.errors import ConfigError
from shardtune.model.composite import model_parts
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.reward_head import SCORE_LAYER


def apply_freeze_tuning(model: Any, settings: FinetuningSettings) -> Any:
    """finetuning_type freeze: the layers ``trainable_layer_ids`` chooses train, and a reward model's score layer."""
    apply_freeze(model, settings.freeze_trainable_layers, settings.freeze_trainable_modules, settings.llama_pro)
    if settings.score_head:
        model.get_submodule(SCORE_LAYER).requires_grad_(True)
    if settings.gradient_checkpointing:
        # Reentrant checkpointing drops the gradients of a block whose inputs need none (frozen layers before).
        model.enable_input_require_grads()
    return model


def apply_freeze(model: Any, trainable_layers: int, modules: tuple[str, ...], llama_pro: bool = False) -> None:
    """Train only the decoder layers ``trainable_layer_ids`` chooses, and in them ``modules`` (or all)."""
    layers = decoder_layer_prefixes(model)
    chosen = [layers[i] for i in trainable_layer_ids(len(layers), trainable_layers, llama_pro)]
    wanted = set(modules)
    matched = False
    for name, param in model.named_parameters():
        in_layer = any(name.startswith(prefix + ".") for prefix in chosen)
        in_module = "all" in wanted or any(f".{m}." in name for m in wanted)
        param.requires_grad_(in_layer and in_module)
        matched |= in_layer and in_module
    if not matched:
        raise ConfigError(f"freeze_trainable_modules ({','.join(modules)}): no parameter of the chosen layers "
                          "matches; use 'all' or names such as mlp, self_attn")


def decoder_layer_prefixes(model: Any) -> list[str]:
    """Names like ``model.layers.3`` of each decoder layer, in order (an image-text model's language model only:
    its vision tower has layers too)."""
    pattern = re.compile(r"^(.*\.layers\.\d+)\.")
    parts = model_parts(model)
    seen: dict[str, None] = {}
    for name, _ in model.named_parameters():
        match = pattern.match(name)
        if match and (parts is None or parts.part_of(match.group(1)) == "language"):
            seen.setdefault(match.group(1), None)
    return list(seen)


def trainable_layer_ids(num_layers: int, trainable_layers: int, llama_pro: bool = False) -> list[int]:
    """The decoder layers freeze tuning trains: the last ``trainable_layers`` (the first ``-n`` when negative); with
    LLaMA-Pro the blocks its expansion inserted, the last of every ``num_layers / trainable_layers`` (LLaMA-Factory's
    rule). A ConfigError when the numbers do not fit the model."""
    problem = layer_count_problem(num_layers, trainable_layers, llama_pro)
    if problem:
        raise ConfigError(problem)
    if llama_pro:
        stride = num_layers // trainable_layers
        return list(range(stride - 1, num_layers, stride))
    count = abs(trainable_layers)
    return list(range(num_layers - count, num_layers)) if trainable_layers > 0 else list(range(count))


def layer_count_problem(num_layers: int, trainable_layers: int, llama_pro: bool) -> str | None:
    """What is wrong with ``freeze_trainable_layers`` for a model of ``num_layers`` decoder layers (also checked on
    the launching host from config.json)."""
    if llama_pro:
        if trainable_layers <= 0 or num_layers % trainable_layers:
            return (f"use_llama_pro: freeze_trainable_layers ({trainable_layers}) must be the number of blocks the "
                    f"expansion added, which divides the model's {num_layers} layers; `shardtune expand-model` "
                    "writes such a model")
        return None
    count = abs(trainable_layers)
    if count == 0 or count > num_layers:
        return (f"freeze_trainable_layers ({trainable_layers}): the model has {num_layers} layers; use "
                f"1..{num_layers} (or a negative number for the first layers)")
    return None
