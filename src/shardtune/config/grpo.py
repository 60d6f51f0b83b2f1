"""The rules of stage grpo, read from the config before any rank starts: its keys' ranges, its reward functions,
the batch its groups need, and what it cannot run with (one table, ``GRPO_REFUSED``)."""

from __future__ import annotations

from shardtune.config.rewards import reward_function_problems
from shardtune.config.schema import TrainConfig

# The settings of the importance-sampling correction of a generator with weights of its own (TRL's names).
SAMPLER_SETTINGS = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                    "vllm_importance_sampling_clip_min")
# Keys of stage grpo only; set for another stage they would be ignored.
GRPO_KEYS = ("reward_funcs", "reward_weights", "reward_format_regex", "num_generations", "max_completion_length",
             "beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards", "num_iterations",
             "mask_truncated_completions", "use_bias_correction_kl", "rollout_backend",
             "vllm_importance_sampling_correction", *SAMPLER_SETTINGS)

# What stage grpo does not do, by key: why, for the refusal's line. A key counts as set when it differs from its
# default (a value in a tuple: when it is that value).
GRPO_REFUSED: dict[str, str] = {
    "packing": "rollouts are whole prompt + completion rows scored per group; packed rows are not built for them",
    "neat_packing": "rollouts are whole prompt + completion rows scored per group; packed rows are not built for them",
    "padding_free": "rollouts are padded prompt + completion rows",
    "sequence_parallel_size": "generation runs whole sequences on each rank and is not split",
    "streaming": "prompts are read from a map-style dataset (the prompt cursor of a resumed run is its index)",
    "micro_batch_tokens": "a micro-batch is num_generations x prompts completions, not a token budget",
    "group_by_length": "the prompt's length says nothing of its completions'",
    "neftune_noise_alpha": "the noise would reach the generation and the reference's forward",
    "do_eval": "evaluation of stage grpo (rewards on held-out prompts) is not built yet",
    "val_size": "evaluation of stage grpo (rewards on held-out prompts) is not built yet",
    "eval_dataset": "evaluation of stage grpo (rewards on held-out prompts) is not built yet",
    "ref_model": "the reference of stage grpo is the model as loaded (LoRA: adapters off; full: a frozen copy)",
    "use_llama_pro": "not built for stage grpo",
    "mixture_of_depths": "not built for stage grpo",
    "tokenized_path": "prompts are read from the datasets each run (no tokenised copy is saved for them)",
}


def grpo_problems(c: TrainConfig) -> list[str]:
    """Stage grpo's keys set for another stage, or for stage grpo everything it cannot run with: one line each."""
    defaults = TrainConfig()
    if c.stage != "grpo":
        return [f"{key} ({getattr(c, key)}) is read by stage grpo only, but stage is {c.stage}; remove it or set "
                "stage: grpo" for key in GRPO_KEYS if getattr(c, key) != getattr(defaults, key)]
    problems = [f"{key} ({getattr(c, key)}) with stage grpo: {why}; remove it"
                for key, why in GRPO_REFUSED.items() if _switched_on(getattr(c, key), getattr(defaults, key))]
    if not c.reward_funcs:
        problems.append("reward_funcs is required with stage grpo: module:function (or path/to/file.py:function, or "
                        "a built-in: answer_match, format_match), comma separated")
    problems += reward_function_problems(c.reward_funcs, c.reward_weights, c.reward_format_regex)
    if c.per_device_train_batch_size % c.num_generations:
        problems.append(f"num_generations ({c.num_generations}) must divide per_device_train_batch_size "
                        f"({c.per_device_train_batch_size}), which counts completions: each micro-batch holds whole "
                        "groups, so a group's advantages need no other rank")
    if c.epsilon_high is not None and c.epsilon_high < c.epsilon and c.loss_type != "gspo":
        problems.append(f"epsilon_high ({c.epsilon_high}) is below epsilon ({c.epsilon}): the upper clip would be "
                        "tighter than the lower; raise epsilon_high or remove it")
    if c.max_completion_length + 1 > c.cutoff_len:
        problems.append(f"max_completion_length ({c.max_completion_length}) leaves no room for a prompt within "
                        f"cutoff_len ({c.cutoff_len}), which bounds prompt + completion; raise cutoff_len")
    problems += rollout_backend_problems(c.rollout_backend)
    if c.rollout_backend == "vllm_protocol_cpu" and (c.finetuning_type not in ("full", "freeze", "lora") or c.use_dora
                                                     or c.quantization_bit is not None):
        problems.append(f"rollout_backend (vllm_protocol_cpu) with finetuning_type {c.finetuning_type} (use_dora "
                        f"{c.use_dora}, quantization_bit {c.quantization_bit}): the weight sync sends full weights "
                        "or plain LoRA merged; use full, freeze or lora")
    problems += sampler_correction_problems(c, defaults)
    if c.do_sample is False:
        problems.append("do_sample (false) with stage grpo: the num_generations completions of a prompt would all "
                        "be the same greedy one, so every advantage is 0; remove it")
    return problems


def sampler_correction_problems(c: TrainConfig, defaults: TrainConfig) -> list[str]:
    """The correction's settings where they would do nothing (the policy samples itself, or the correction is off),
    bounds that cross, and a truncation with no bound (nothing to clamp to)."""
    changed = [key for key in SAMPLER_SETTINGS if getattr(c, key) != getattr(defaults, key)]
    if c.rollout_backend == "transformers" and changed:
        return [f"{key} ({getattr(c, key)}) corrects a generator with weights of its own (rollout_backend vllm or "
                "vllm_protocol_cpu); with rollout_backend transformers the policy samples with the weights it "
                "trains, so there is no gap to correct; remove it" for key in changed]
    if not c.vllm_importance_sampling_correction:
        return [f"{key} ({getattr(c, key)}) has no effect with vllm_importance_sampling_correction false; remove "
                "one of them" for key in changed]
    low, high = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low > high:
        return [f"vllm_importance_sampling_clip_min ({low}) is above vllm_importance_sampling_clip_max ({high}): "
                "no ratio could pass; lower the one or raise the other"]
    if c.vllm_importance_sampling_mode.endswith("truncate") and low is None and high is None:
        return [f"vllm_importance_sampling_mode ({c.vllm_importance_sampling_mode}) clamps the ratio to its bounds, "
                "and both are null; set vllm_importance_sampling_clip_max (TRL's default: 3.0)"]
    return []


def rollout_backend_problems(backend: str, gpus: int | None = None, has_vllm: bool | None = None) -> list[str]:
    """``rollout_backend: vllm`` needs a GPU and the vllm package, and its client is not built yet (the weight-sync
    protocol it would speak is: train/weight_sync.py); one line naming the key, whatever is missing first."""
    if backend != "vllm":
        return []
    import importlib.util

    from shardtune.host import visible_gpu_count

    gpus = visible_gpu_count() if gpus is None else gpus
    has_vllm = importlib.util.find_spec("vllm") is not None if has_vllm is None else has_vllm
    if gpus == 0:
        why = "vLLM generates on a GPU and this machine has none"
    elif not has_vllm:
        why = "the vllm package is not installed (pip install vllm)"
    else:
        why = "its client is not built yet (the weight-sync protocol it would speak is, docs/grpo.md)"
    return [f"rollout_backend (vllm): {why}; use rollout_backend: transformers (the policy generates itself)"]


def _switched_on(value: object, default: object) -> bool:
    """Set to something that turns the feature on: not its default, nor off (false, null, an empty list)."""
    return value != default and value not in (None, False, [], 0)
