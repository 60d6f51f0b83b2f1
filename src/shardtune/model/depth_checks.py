"""Mixture of depths checked without torch (model/depths.py routes the layers): which checkpoints
``mixture_of_depths: convert | load`` can route, from their config.json, before launch and on the rank."""

from __future__ import annotations

from typing import Any

from shardtune.config.schema import TrainConfig

CONFIG_KEY = "mixture_of_depths"
# Families whose decoder layer takes (hidden_states, attention_mask, position_ids, position_embeddings): the chosen
# tokens carry their own positions and mask rows. LLaMA-Factory's list for the MoD package, less the ALiBi models
# (bloom, falcon: their bias is built for the whole row inside attention), plus the Qwen families of the same layer.
FAMILIES = ("llama", "mistral", "mixtral", "gemma", "phi", "starcoder2", "qwen2", "qwen3")
MODES = ("convert", "load")


def depth_problem(mode: str, config_json: dict[str, Any]) -> str | None:
    """Why ``mixture_of_depths: mode`` cannot route this checkpoint (checked before launch and on the rank)."""
    if mode not in MODES:
        return f"mixture_of_depths ({mode}): use convert (add routers to a checkpoint) or load (a routed one)"
    model_type = config_json.get("model_type")
    if model_type not in FAMILIES:
        return (f"mixture_of_depths ({mode}): model_type '{model_type}' is not routed (families whose layers take "
                f"their positions from outside: {', '.join(FAMILIES)})")
    routed = CONFIG_KEY in config_json
    if mode == "convert" and routed:
        return "mixture_of_depths (convert): this checkpoint already has routers (its config.json says so); use load"
    if mode == "load" and not routed:
        return "mixture_of_depths (load): this checkpoint has no routers (no mixture_of_depths in config.json); " \
               "use convert"
    return None


def depth_checkpoint_problems(c: TrainConfig) -> list[str]:
    """mixture_of_depths against the model's config.json: a family whose layers can be routed, routers or not."""
    if not c.mixture_of_depths:
        return []
    from shardtune.model.attention import known_model_config

    known = known_model_config(c.model_name_or_path or "", builds_tiny_model=c.build_tiny_model_if_missing)
    problem = depth_problem(c.mixture_of_depths, known) if known is not None else None
    return [problem] if problem else []
