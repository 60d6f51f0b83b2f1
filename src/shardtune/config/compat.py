"""Keys spelled as LLaMA-Factory or the Hugging Face Trainer spell them, translated into shardtune's own.

A file written for LLaMA-Factory runs unchanged: each key here is rewritten into shardtune keys (``MAPPED``)
before the config is built, so the rest of shardtune sees one spelling. Keys shardtune cannot honour are refused
with the reason and what to do (``refused.UNSUPPORTED_KEYS``); nothing is silently ignored. ``shardtune
convert-config`` prints, for every key of a file, which of the three it is.

To add a spelling: write a function ``(value, all_values) -> {shardtune key: value}`` and register it in
``MAPPED`` with a one-line description of what it becomes. A translation may raise ``ValueError`` with a message
that names the key; it is reported with the other problems of the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardtune.config.refused import V1_KERNELS_MEANING
from shardtune.config.schema import key_names

Translate = Callable[[Any, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Mapped:
    """A key rewritten into shardtune keys; ``becomes`` says into what, for ``convert-config``."""

    becomes: str
    translate: Translate


def _rename(target: str) -> Translate:
    return lambda value, _values: {target: value}


class Refused(ValueError):
    """A known key whose value shardtune cannot honour (not a mistyped value): ``convert-config`` lists it as
    refused, with ``reason``."""

    def __init__(self, key: str, value: Any, reason: str) -> None:
        super().__init__(f"key '{key}' ({value!r}): {reason}")
        self.reason = reason


def _refuse_unless(accepted: Any, reason: str) -> Callable[[str], Translate]:
    """A key whose ``accepted`` value is what shardtune does anyway; any other value is refused with ``reason``."""

    def for_key(key: str) -> Translate:
        def translate(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
            if value == accepted or value is None:
                return {}
            raise Refused(key, value, reason)

        return translate

    return for_key


# --- attention kernel (attention) ---
# LLaMA-Factory's `flash_attn` -> transformers' attn_implementation. `auto` stays auto: the launching host picks a
# kernel the model supports (model/attention.py) and says which, with the reason, in the run log.
FLASH_ATTN = {"auto": "auto", "sdpa": "sdpa", "disabled": "eager", "eager": "eager", "fa2": "flash_attention_2"}


def _flash_attn(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    choice = str(value).strip().lower()
    if choice not in FLASH_ATTN:
        raise ValueError(f"flash_attn: {value!r} is not allowed; choose one of: auto, disabled, sdpa, fa2")
    return {"attn_implementation": FLASH_ATTN[choice]}


def _gradient_checkpointing_off(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise ValueError(f"disable_gradient_checkpointing: expected true/false, got {value!r}")
    return {"gradient_checkpointing": not value}


def _use_reentrant(value: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise ValueError(f"use_reentrant_gc: expected true/false, got {value!r}")
    if values.get("disable_gradient_checkpointing") is True:
        # LLaMA-Factory's examples keep `use_reentrant_gc: true` beside it; there it is ignored, so here too.
        return {}
    given = values.get("gradient_checkpointing_kwargs")
    return {"gradient_checkpointing_kwargs": {**(given if isinstance(given, dict) else {}), "use_reentrant": value}}


def _into_fsdp_config(name: str) -> Translate:
    """A Trainer ``fsdp_*`` key given at the top level -> the same key inside ``fsdp_config`` (merged with it)."""

    def translate(value: Any, values: Mapping[str, Any]) -> dict[str, Any]:
        given = values.get("fsdp_config")
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"key '{name}' with fsdp_config read from a file ({given}): put {name} into that file")
        short = name.removeprefix("fsdp_")
        for spelling in (name, short):
            if given and spelling in given and given[spelling] != value:
                raise ValueError(f"key '{name}' ({value!r}) contradicts fsdp_config.{spelling} "
                                 f"({given[spelling]!r}); keep one")
        return {"fsdp_config": {**(given or {}), name: value}}

    return translate


# Another spelling -> what it becomes. Grouped as the schema is; each group is owned by the code that honours it.
MAPPED: dict[str, Mapped] = {
    # --- training arguments of the Hugging Face Trainer ---
    "evaluation_strategy": Mapped("eval_strategy (its newer name)", _rename("eval_strategy")),
    "use_liger_kernel": Mapped("enable_liger_kernel (the Hugging Face Trainer's name)", _rename("enable_liger_kernel")),
    # --- attention kernel (attention): auto resolved per model on the launching host ---
    "flash_attn": Mapped("attn_implementation (auto: auto, sdpa: sdpa, disabled: eager, fa2: flash_attention_2)",
                         _flash_attn),
    # --- model, outputs and memory (lfkeys) ---
    "disable_gradient_checkpointing": Mapped("gradient_checkpointing (negated)", _gradient_checkpointing_off),
    "use_reentrant_gc": Mapped("gradient_checkpointing_kwargs.use_reentrant", _use_reentrant),
    "fsdp_transformer_layer_cls_to_wrap": Mapped(
        "fsdp_config.transformer_layer_cls_to_wrap", _into_fsdp_config("fsdp_transformer_layer_cls_to_wrap")),
    "fsdp_min_num_params": Mapped("fsdp_config.min_num_params", _into_fsdp_config("fsdp_min_num_params")),
    "save_safetensors": Mapped("nothing: safetensors is the only format written", _refuse_unless(
        True, "shardtune writes models only as safetensors; remove the key or set it to true")("save_safetensors")),
    # --- vocabulary, precision and trackers (lfkeys2) ---
    "new_special_tokens": Mapped("add_special_tokens (its newer name)", _rename("add_special_tokens")),
    "init_special_tokens": Mapped("nothing: new rows always start as noise_init does", _refuse_unless(
        "noise_init", "shardtune starts new token rows as noise_init does (mean of the old rows plus noise); "
                      "desc_init needs token descriptions it does not read. Remove the key")("init_special_tokens")),
    # --- what shardtune always does, spelled as LLaMA-Factory's switches (lead) ---
    "ignore_pad_token_for_loss": Mapped("nothing: padding never counts in the loss", _refuse_unless(
        True, "shardtune always leaves padding out of the loss; remove the key or set it to true")(
        "ignore_pad_token_for_loss")),
    "include_effective_tokens_per_second": Mapped(
        "nothing: train_results.json always records throughput.effective_tokens_per_second", _refuse_unless(
            True, "shardtune always records effective tokens per second; remove the key")(
            "include_effective_tokens_per_second")),
    "use_fast_tokenizer": Mapped("nothing: the fast (Rust) tokenizer is always used", _refuse_unless(
        True, "shardtune loads the fast tokenizer only (tokenizer.json); remove the key or set it to true")(
        "use_fast_tokenizer")),
    "disable_shuffling": Mapped("nothing: the training order is shuffled with the run's seed", _refuse_unless(
        False, "shardtune always shuffles the training data with `seed` (group_by_length keeps lengths together); "
               "remove the key")("disable_shuffling")),
}


# --- adapters and training extras (adapters) ---
def _tokens_seen(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainer's booleans: true counts every input token (padding included), false none."""
    if isinstance(value, bool):
        return {"include_num_input_tokens_seen": "all" if value else "no"}
    text = str(value).strip().lower()
    return {"include_num_input_tokens_seen": {"true": "all", "false": "no"}.get(text, text)}


# LLaMA-Factory's optimizer replacements (optextras): Muon, GaLore, APOLLO (layer-wise too), Adam-mini and BAdam's
# layer mode are schema keys under their own names (engines.plan refuses them where they cannot work). BAdam's ratio
# mode is refused before launch (launch/optimizer_checks.py); its two settings are read by nothing else.
def _inert_setting(_value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    """A setting read only by a mode that is refused when chosen: inert otherwise (as in LLaMA-Factory)."""
    return {}


MAPPED.update({
    "include_num_input_tokens_seen": Mapped("include_num_input_tokens_seen (true: all, false: no)", _tokens_seen),
    **{key: Mapped("nothing: only read by badam_mode: ratio, which is refused", _inert_setting)
       for key in ("badam_update_ratio", "badam_mask_mode")},
})


# --- preference training (pref) ---
# LLaMA-Factory's preference keys (pref_beta, pref_loss, pref_ftx, simpo_gamma, dpo_label_smoothing, kto_*_weight,
# ref_model*) are schema keys under their own names (schema.py, group "preference"). Only pref_loss needs a word
# here: values LLaMA-Factory accepted once, which shardtune does not train, are refused with what to use instead.
PREF_LOSS_REPLACED = {"kto_pair": "the paired KTO loss was dropped by TRL; use stage: kto with a kto_tag dataset",
                      "bco_pair": "BCO is not implemented; use pref_loss sigmoid (DPO) or stage: kto"}


def _pref_loss(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(value, str) and value in PREF_LOSS_REPLACED:  # other types: the schema's type check names them
        raise Refused("pref_loss", value, PREF_LOSS_REPLACED[value])
    return {"pref_loss": value}


MAPPED["pref_loss"] = Mapped("pref_loss (kto_pair and bco_pair refused with what to use)", _pref_loss)


# --- sequence parallelism (engines/sequence_parallel_plan.py) ---
# LLaMA-Factory v1's context parallelism has the one mode ulysses (its default); shardtune's mode also gathers K/V.
def _cp_mode(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    if str(value).strip().lower() == "ulysses":
        return {"sequence_parallel_mode": "ulysses"}
    raise Refused("cp_mode", value, "LLaMA-Factory's context parallelism has the mode ulysses only; write "
                                    "sequence_parallel_mode: ulysses, allgather or auto")


MAPPED.update({
    "cp_size": Mapped("sequence_parallel_size (LLaMA-Factory v1's context-parallel size)",
                      _rename("sequence_parallel_size")),
    "cp_mode": Mapped("sequence_parallel_mode (ulysses; LLaMA-Factory v1 has no other)", _cp_mode),
    "context_parallel_size": Mapped("sequence_parallel_size (axolotl's and Megatron's context-parallel size)",
                                    _rename("sequence_parallel_size")),
    # --- expert parallelism (engines/expert_parallel_plan.py) ---
    "ep_size": Mapped("expert_parallel_size (LLaMA-Factory v1's dist_config.ep_size)", _rename("expert_parallel_size")),
    "expert_parallel_degree": Mapped("expert_parallel_size (torchtitan's parallelism.expert_parallel_degree)",
                                     _rename("expert_parallel_size")),
    "expert_model_parallel_size": Mapped("expert_parallel_size (Megatron's expert-parallel size)",
                                         _rename("expert_parallel_size")),
})


# --- video settings: read only with a videos column, which shardtune refuses (data/registry.py) ---
MAPPED.update({key: Mapped("nothing: only read with videos, whose column is refused by name", _inert_setting)
               for key in ("video_fps", "video_max_pixels", "video_maxlen", "video_min_pixels")})


# --- torchtitan's checkpoint.async_mode: staging always uses pinned memory on a GPU here ---
TORCHTITAN_ASYNC_MODES = {"disabled": False, "async": True, "async_with_pinned_mem": True}


def _async_mode(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    mode = str(value).strip().lower()
    if mode not in TORCHTITAN_ASYNC_MODES:
        raise ValueError(f"key 'async_mode' ({value!r}): torchtitan's modes are {', '.join(TORCHTITAN_ASYNC_MODES)}")
    return {"async_save": TORCHTITAN_ASYNC_MODES[mode]}


MAPPED["async_mode"] = Mapped("async_save (torchtitan's checkpoint.async_mode: disabled -> false, async and "
                              "async_with_pinned_mem -> true)", _async_mode)


# --- LLaMA-Factory's use_v1_kernels: its v1 "auto" kernel set, which lists kernels for Ascend NPUs only ---
MAPPED["use_v1_kernels"] = Mapped(f"nothing: {V1_KERNELS_MEANING}", _inert_setting)


# --- online RL (stage grpo, config/grpo.py): TRL's GRPOConfig keys are schema keys under their own names; these are
# TRL's other spellings of them and axolotl's (rl: grpo, the TRL settings nested under trl:) ---
AXOLOTL_RL_STAGES = {"grpo": "grpo", "dpo": "dpo", "kto": "kto"}


def _axolotl_rl(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    stage = AXOLOTL_RL_STAGES.get(str(value).strip().lower())
    if stage is None:
        raise Refused("rl", value, f"shardtune maps axolotl's rl {', '.join(AXOLOTL_RL_STAGES)} to its stages; for "
                                   "ipo, orpo or simpo write stage: dpo with pref_loss")
    return {"stage": stage}


def _trl_settings(value: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """axolotl's ``trl:`` mapping: each TRL key as if written at the top level (translated where TRL spells it
    otherwise)."""
    if not isinstance(value, dict):
        raise ValueError(f"key 'trl': expected a mapping of TRL's GRPO settings, got {value!r}")
    found: dict[str, Any] = {}
    for key, setting in value.items():
        if key not in MAPPED and key not in key_names():
            raise ValueError(f"key 'trl': {key!r} is not a TRL setting shardtune reads (see docs/grpo.md)")
        found.update(MAPPED[key].translate(setting, value) if key in MAPPED else {key: setting})
    return found


def _scale_rewards(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    """TRL also takes booleans: true is group, false none."""
    return {"scale_rewards": {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value}


def _importance_sampling_level(value: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    if value in (None, "token"):
        return {}
    if value == "sequence" and values.get("loss_type", "grpo") in ("grpo", "gspo"):
        return {"loss_type": "gspo"}
    raise Refused("importance_sampling_level", value, "sequence-level ratios are loss_type gspo here (TRL's grpo "
                                                      "with importance_sampling_level sequence); write loss_type: gspo")


def _loss_type(value: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's grpo with sequence-level ratios is gspo (importance_sampling_level says which)."""
    sequence = values.get("importance_sampling_level") == "sequence"
    return {"loss_type": "gspo" if sequence and value == "grpo" else value}


def _reward_funcs(value: Any, _values: Mapping[str, Any]) -> dict[str, Any]:
    """axolotl names a reward function module.function; shardtune (like a path) module:function."""
    specs = value if isinstance(value, list) else [value]
    return {"reward_funcs": [s if not isinstance(s, str) or ":" in s or "." not in s else ":".join(s.rsplit(".", 1))
                             for s in specs]}


MAPPED.update({
    "rl": Mapped("stage (axolotl's rl: grpo, dpo, kto)", _axolotl_rl),
    "trl": Mapped("the TRL settings in it, each as its own key (axolotl's trl: mapping)", _trl_settings),
    "scale_rewards": Mapped("scale_rewards (TRL's true: group, false: none)", _scale_rewards),
    "importance_sampling_level": Mapped("loss_type gspo (TRL's grpo with sequence-level ratios)",
                                        _importance_sampling_level),
    "reward_funcs": Mapped("reward_funcs (axolotl's module.function -> module:function)", _reward_funcs),
    "loss_type": Mapped("loss_type (grpo with importance_sampling_level sequence: gspo)", _loss_type),
    "vllm_importance_sampling_cap": Mapped("vllm_importance_sampling_clip_max (TRL's older name)",
                                           _rename("vllm_importance_sampling_clip_max")),
    "use_vllm": Mapped("nothing: the transformers back-end generates (false only)", _refuse_unless(
        False, "the vLLM back-end of stage grpo is not built yet: the policy generates with transformers; remove "
               "the key")("use_vllm")),
})


def translate_keys(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` with every mapped key rewritten; (result, problems). A key given in both spellings is a problem
    unless both say the same."""
    result = {key: value for key, value in values.items() if key not in MAPPED}
    problems: list[str] = []
    for key, value in values.items():
        if key not in MAPPED:
            continue
        try:
            produced = MAPPED[key].translate(value, values)
        except ValueError as err:
            problems.append(str(err))
            continue
        for target, new in produced.items():
            current = result.get(target)
            if isinstance(current, dict) and isinstance(new, dict) and _agree(current, new):
                new = {**current, **new}  # several keys fill one mapping (fsdp_config)
            elif target in result and current != new:
                problems.append(f"key '{key}' ({value!r}) contradicts '{target}' ({result[target]!r}); keep one")
                continue
            result[target] = new
    return result, problems


def _agree(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    return all(first[key] == second[key] for key in first.keys() & second.keys())
