"""What stage grpo puts into the common workflow (its prompts come from data/rl_prompts.py through
train/setup.py): its objective (rollouts, rewards, reference) and
the loader's windows repeated ``num_iterations`` times."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shardtune.config.schema import TrainConfig
from shardtune.engines.base import Engine
from shardtune.model.source import ModelSource
from shardtune.train.grpo_loss import GrpoSettings, SamplerCorrection
from shardtune.train.grpo_rewards import RewardSet
from shardtune.train.grpo_step import GrpoObjective
from shardtune.train.rollout import Rollout, Sampling, TransformersRollout
from shardtune.train.weight_sync import WeightSync


def build_grpo_objective(c: TrainConfig, source: ModelSource, engine: Engine, tokenizer: Any) -> GrpoObjective:
    """The objective of a grpo run; the reference (beta > 0) is placed as dpo's."""
    from shardtune.infer.generation import stop_token_ids
    from shardtune.train.predict import prediction_stop_token
    from shardtune.train.preference_step import live_reference, reference_source

    reference = None
    if c.beta > 0:
        reference = live_reference(engine, reference_source(source), c.finetuning_type)
    settings = GrpoSettings(loss_type=c.loss_type, beta=c.beta, epsilon=c.epsilon, epsilon_high=c.epsilon_high,
                            temperature=c.temperature, use_bias_correction_kl=c.use_bias_correction_kl)
    sampling = Sampling(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                        max_completion_length=c.max_completion_length, seed=c.seed)
    stops = stop_token_ids(tokenizer, prediction_stop_token(tokenizer, c))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    rollout, weight_sync, backend = rollout_backend(c, source, engine, stops, pad)
    correction = sampler_correction(c) if weight_sync is not None else None
    if engine.is_main:
        where = "none (beta 0)" if reference is None else reference.kind
        corrected = "" if correction is None else f"; sampler gap corrected ({correction.mode})"
        print(f"[shardtune] stage grpo: loss_type {c.loss_type}, {c.num_generations} completions per prompt "
              f"({backend}{corrected}), rewards {', '.join(c.reward_funcs)}; reference: {where}", flush=True)
    return GrpoObjective(settings, sampling, RewardSet.load(c.reward_funcs, c.reward_weights, c.reward_format_regex,
                                                            engine.device, tokenizer),
                         rollout, tokenizer, c.num_generations, c.scale_rewards,
                         c.num_iterations, c.mask_truncated_completions, reference, weight_sync, correction)


def sampler_correction(c: TrainConfig) -> SamplerCorrection | None:
    """TRL's vllm_importance_sampling_* for a generator with weights of its own (None: turned off)."""
    if not c.vllm_importance_sampling_correction:
        return None
    return SamplerCorrection(c.vllm_importance_sampling_mode, c.vllm_importance_sampling_clip_min,
                             c.vllm_importance_sampling_clip_max)


def rollout_backend(c: TrainConfig, source: ModelSource, engine: Engine, stops: list[int], pad: int
                    ) -> tuple[Rollout, WeightSync | None, str]:
    """Who generates: the policy itself, or (vllm_protocol_cpu, the vLLM protocol's CPU test double) a generator
    process with its own copy of the weights, started by rank 0 and synced after every step."""
    if c.rollout_backend != "vllm_protocol_cpu":
        return TransformersRollout(engine, stops, pad), None, "transformers back-end: the policy generates with " \
            "its own weights"
    import torch

    from shardtune.train.protocol_generator import connect_generator

    dtype = torch.bfloat16 if c.bf16 else torch.float16 if c.fp16 else torch.float32
    client, process = connect_generator(engine, source.name_or_path, dtype, stops, pad)
    sync = WeightSync(client if engine.is_main else None, keep=process)
    return client, sync, "vllm_protocol_cpu: a generator process with its own weights, streamed after every step"


def repeated_windows(epoch_batches: Callable[[int, int], Iterable[Any]], window: int, times: int
                     ) -> Callable[[int, int], Iterable[Any]]:
    """``epoch_batches`` with every window of ``window`` micro-batches handed ``times`` times in a row (the same
    objects: the objective knows a repeat by them). ``skip`` counts repeated micro-batches; a run resumed between
    two repeats starts the interrupted window's remaining repeats (on the rollouts the checkpoint carries:
    train/grpo_group.py)."""
    if times == 1:
        return epoch_batches

    def for_epoch(epoch: int, skip: int = 0) -> Iterator[Any]:
        done_windows, left_over = divmod(skip, window * times)
        source = iter(epoch_batches(epoch, done_windows * window))
        first = True
        while True:
            micro = list(itertools.islice(source, window))
            if not micro:
                return
            repeats = times - left_over // window if first else times
            first = False
            for _ in range(repeats):
                yield from micro

    return for_epoch
