"""What a stage trains besides the token loss: dpo/kto's preference step and its reference, rm's pairwise step,
ASFT's anchor, and the reference log-probabilities scored before the first step."""

from __future__ import annotations

import time
from typing import Any

from shardtune.config.adapter_method import is_adapter_type
from shardtune.config.schema import TrainConfig
from shardtune.engines.base import Engine
from shardtune.errors import ConfigError
from shardtune.model.source import ModelSource
from shardtune.train import checkpoint
from shardtune.train.checkpoint import resume_source
from shardtune.train.loop import AnchorSource, Objective
from shardtune.train.setup import build_collator


def stage_objective(c: TrainConfig, source: ModelSource, engine: Engine, tokenizer: Any = None) -> Objective | None:
    """dpo/kto: the preference step and its reference (a full-parameter run's frozen model loaded from the policy's
    ``source`` and placed by the engine); rm: the pairwise reward step; grpo: rollouts and the clipped surrogate
    (train/grpo_step.py); None (the token loss) for sft and pt."""
    if c.stage == "grpo":
        from shardtune.train.grpo_run import build_grpo_objective

        if c.beta > 0:
            refuse_trained_reference(c, "stage grpo with beta > 0")
        return build_grpo_objective(c, source, engine, tokenizer)
    if c.stage == "rm":
        from shardtune.train.reward import RewardObjective

        if engine.is_main:
            print("[shardtune] stage rm: a one-label sequence-classification model (score at the last token), "
                  "pairwise loss", flush=True)
        assert source.reward_head is not None  # model_source gives stage rm its score head
        return RewardObjective(source.reward_head.pad_token_id)
    if c.stage not in ("dpo", "kto"):
        return None
    from shardtune.config.preference import split_paths
    from shardtune.train.preference import PreferenceSettings
    from shardtune.train.preference_step import PreferenceObjective, build_reference, reference_source

    settings = PreferenceSettings(loss=c.pref_loss, beta=c.pref_beta, ftx=c.pref_ftx, simpo_gamma=c.simpo_gamma,
                                  label_smoothing=c.dpo_label_smoothing, kto_chosen_weight=c.kto_chosen_weight,
                                  kto_rejected_weight=c.kto_rejected_weight)
    if settings.needs_reference:
        refuse_trained_reference(c, f"stage {c.stage}")
    ref_source = reference_source(source, c.ref_model, split_paths(c.ref_model_adapters), c.ref_model_quantization_bit)
    reference = build_reference(engine, ref_source, c.finetuning_type, settings, c.precompute_ref_log_probs,
                                separate=c.ref_model is not None)
    if engine.is_main:
        frozen = f"ref_model {c.ref_model} (frozen)" if c.ref_model else "a frozen copy of the model"
        where = {"none": "none (the loss compares the policy with itself)",
                 "precomputed": "precomputed before the first step (precompute_ref_log_probs)",
                 "adapters_off": "the model with its LoRA adapters off (no copy)",
                 "copy": f"{frozen}, whole on every rank",
                 "sharded": f"{frozen}, sharded as the policy ({engine.name})"}[reference.kind]
        print(f"[shardtune] stage {c.stage}" + (f", pref_loss {c.pref_loss}" if c.stage == "dpo" else "")
              + f"; reference model: {where}; log-probabilities from the full logits (loss_chunk_size does not "
              "apply)", flush=True)
    return PreferenceObjective(c.stage, settings, reference)


def refuse_trained_reference(c: TrainConfig, user: str) -> None:
    """A full-parameter run's reference is loaded from the model's source, which a model-only checkpoint replaces
    with the trained weights on resume."""
    resumed = resume_source(c)
    if not is_adapter_type(c.finetuning_type) and c.ref_model is None and resumed is not None \
            and checkpoint.is_model_only(resumed):
        raise ConfigError(f"resuming {user} ({c.finetuning_type}) from {resumed}, a model-only checkpoint "
                          "(save_only_model): the model is built from its trained weights, so the reference would be "
                          "the trained model, not the original; resume from a full checkpoint")


def asft_anchor(c: TrainConfig, source: ModelSource, engine: Engine) -> AnchorSource | None:
    """use_asft_loss: the reference whose distribution anchors the policy (train/anchor.py); None otherwise."""
    if not c.use_asft_loss:
        return None
    from shardtune.config.preference import split_paths
    from shardtune.train.anchor import build_anchor
    from shardtune.train.preference_step import reference_source

    refuse_trained_reference(c, "use_asft_loss")
    ref_source = reference_source(source, c.ref_model, split_paths(c.ref_model_adapters), c.ref_model_quantization_bit)
    anchor = build_anchor(engine, ref_source, c.finetuning_type, c.asft_alpha, separate=c.ref_model is not None)
    if engine.is_main:
        frozen = f"ref_model {c.ref_model} (frozen)" if c.ref_model else "a frozen copy of the model"
        where = {"adapters_off": "the model with its adapters off (no copy)", "copy": f"{frozen}, whole on every rank",
                 "sharded": f"{frozen}, sharded as the policy ({engine.name})"}[anchor.reference.kind]
        print(f"[shardtune] use_asft_loss: DFT plus {c.asft_alpha} x KL(reference || policy) per trainable token; "
              f"reference model: {where}; its logits are computed whole", flush=True)
    return anchor


def with_reference_logps(engine: Engine, tokenizer: Any, c: TrainConfig, train_set: Any, eval_set: Any
                         ) -> tuple[Any, Any]:
    """precompute_ref_log_probs: score the train (and eval) samples with the untrained policy, before any step and
    before a checkpoint is loaded, and add them as a ``ref_logps`` column."""
    from shardtune.train.preference_step import precomputed_reference_logps

    started = time.perf_counter()
    scored: list[Any] = []
    for dataset in (train_set, eval_set):
        if dataset is None:
            scored.append(None)
            continue
        values = precomputed_reference_logps(engine, dataset, build_collator(tokenizer, c),
                                             c.per_device_train_batch_size, c.finetuning_type)
        scored.append(dataset.add_column("ref_logps", values))
    if engine.is_main:
        print(f"[shardtune] precompute_ref_log_probs: {sum(len(d) for d in scored if d is not None)} samples scored "
              f"by the reference in {time.perf_counter() - started:.1f} s; no reference is kept in memory", flush=True)
    return scored[0], scored[1]
