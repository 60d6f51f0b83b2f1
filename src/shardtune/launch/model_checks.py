"""Checks of a run against its model's config.json, on the launching host: the attention kernel and packing, the
table of positions, mixture-of-experts rules, and the decoder layers that freeze tuning and BAdam choose from."""

from __future__ import annotations

from shardtune.config.preference import PREFERENCE_STAGES
from shardtune.config.schema import TrainConfig
from shardtune.errors import ModelError
from shardtune.model.folder import model_config_json
from shardtune.model.moe import configured_router_aux_coef, packed_aux_loss_problem, preference_aux_loss_problem
from shardtune.train.settings import resolved_packing


def layer_problems(c: TrainConfig) -> list[str]:
    """freeze_trainable_layers (freeze tuning, LLaMA-Pro) and badam_start_block against the model's decoder layers
    (config.json), as the ranks will choose them."""
    freezes = c.use_llama_pro or (c.finetuning_type == "freeze" and c.freeze_trainable_layers != 0)
    starts = c.use_badam and c.badam_start_block is not None
    if not (freezes or starts):
        return []  # freeze_trainable_layers 0 without LLaMA-Pro: said by schedule_problems already
    from shardtune.model.finetuning.freeze import layer_count_problem

    layers = decoder_layer_count(c)
    if layers is None:
        return []
    problems = []
    if freezes and (problem := layer_count_problem(layers, c.freeze_trainable_layers, c.use_llama_pro)):
        problems.append(problem)
    if starts and c.badam_start_block is not None and not 0 <= c.badam_start_block < layers:
        problems.append(f"badam_start_block ({c.badam_start_block}): the model has {layers} decoder layers, BAdam's "
                        f"blocks 0 to {layers - 1}; choose one of them or leave it unset")
    return problems


def decoder_layer_count(c: TrainConfig) -> int | None:
    """num_hidden_layers of the model's config.json (its text config's for an image-text folder), None if unknown."""
    from shardtune.model.attention import known_model_config

    known = known_model_config(c.model_name_or_path or "", builds_tiny_model=c.build_tiny_model_if_missing) or {}
    nested = known.get("text_config")
    layers = (nested if isinstance(nested, dict) else known).get("num_hidden_layers")
    return layers if type(layers) is int else None


def attention_problems(c: TrainConfig) -> list[str]:
    """A kernel the model cannot run, or packed rows it cannot keep apart under that kernel (a model whose config
    is here, a local folder or the hub cache, with a chosen kernel; ``auto`` is resolved before this runs)."""
    from shardtune.engines.sequence_parallel_plan import refusal_for
    from shardtune.model.attention import AUTO, kernel_problem, kernel_support, packing_problem

    if refusal_for(c, "attn_implementation"):
        return []  # a kernel the split replaces: sequence_parallel_problems says so (the COMBINATIONS table)
    try:
        config = model_config_json(c.model_name_or_path)
    except ModelError:
        return []  # reported by the folder checks
    if config is None or c.attn_implementation == AUTO:
        return []
    support = kernel_support(config)
    model = str(c.model_name_or_path)
    problem = kernel_problem(c.attn_implementation, support, model)
    if problem is None and resolved_packing(c):
        problem = packing_problem(config, support, c.attn_implementation, model) or packed_aux_loss_problems(c, config)
    return [problem] if problem else []


def position_problems(c: TrainConfig) -> list[str]:
    """Rows longer than a model's table of positions (model/positions.py)."""
    from shardtune.model.positions import position_problem

    try:
        config = model_config_json(c.model_name_or_path)
    except ModelError:
        return []  # reported by the folder checks
    problem = position_problem(c.cutoff_len, config, str(c.model_name_or_path)) if config else None
    return [problem] if problem else []


def packed_aux_loss_problems(c: TrainConfig, config: dict) -> str | None:
    """sft packs rows with a block mask (flash, varlen: none), which transformers' router aux loss cannot read."""
    from shardtune.data.settings import takes_offsets

    if c.stage != "sft" or takes_offsets(c.attn_implementation):
        return None
    return packed_aux_loss_problem() if configured_router_aux_coef(config, c.moe_aux_loss_coef) else None


def moe_problems(c: TrainConfig) -> list[str]:
    """Mixture-of-experts rules that need the model's config.json."""
    try:
        config = model_config_json(c.model_name_or_path)
    except ModelError:
        return []  # reported by the folder checks
    coef = configured_router_aux_coef(config or {}, c.moe_aux_loss_coef)
    return [preference_aux_loss_problem(coef, c.stage)] if coef and c.stage in PREFERENCE_STAGES else []
