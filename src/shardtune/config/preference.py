"""Which preference runs hold a reference model, read from the config (the engines, the estimate and validation
all ask here)."""

from __future__ import annotations

from shardtune.config.adapter_method import is_adapter_type
from shardtune.config.schema import TrainConfig

PREFERENCE_STAGES = ("dpo", "kto", "rm")
# These dpo losses compare the policy with itself (chosen vs rejected): no reference model is loaded.
REFERENCE_FREE_LOSSES = ("orpo", "simpo")


def uses_reference(c: TrainConfig) -> bool:
    """kto, and dpo with a loss that compares the policy with a reference."""
    return c.stage == "kto" or (c.stage == "dpo" and c.pref_loss not in REFERENCE_FREE_LOSSES)


def holds_reference_copy(c: TrainConfig) -> bool:
    """A frozen model beside the policy while training: a full/freeze run's live reference (dpo, kto, grpo with
    beta > 0, or the use_asft_loss anchor), or ``ref_model`` (a LoRA or OFT run's own reference is the policy with
    its adapter off; precomputed log-probabilities keep no model)."""
    separate = not is_adapter_type(c.finetuning_type) or c.ref_model is not None
    grpo_kl = c.stage == "grpo" and c.beta > 0
    live = (uses_reference(c) and not c.precompute_ref_log_probs) or c.use_asft_loss or grpo_kl
    return live and separate


def split_paths(value: str | None) -> tuple[str, ...]:
    """``ref_model_adapters``: one path or several, comma-separated (as LLaMA-Factory splits its adapter paths)."""
    return tuple(p.strip() for p in (value or "").split(",") if p.strip())
