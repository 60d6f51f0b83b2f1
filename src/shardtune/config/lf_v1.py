"""LLaMA-Factory's v1 format (``USE_V1=1 llamafactory-cli sft cfg.yaml``), read as it is.

A v1 file keeps a few flat keys under other names (``model``, ``micro_batch_size``, ``dist_timeout``) and puts each
plugin's settings into its own section (``peft_config``, ``dist_config``, ``kernel_config``, ``quant_config``,
``init_config``, ``optim_config``, ``lr_scheduler_config``), each with a ``name``. ``translate_v1`` rewrites such a
file into shardtune's keys in one pass, before ``compat`` and the schema see it, and fills in the defaults where v1's
differ from shardtune's (full fine-tuning without a ``peft_config``, bf16, constant learning rate, the tokenizer's
own chat template, ...), so the run is the one v1 would make. A v1 setting with no counterpart is refused with a
reason that starts with ``V1_PREFIX``: the first line of the refusal says the v1 format is the cause.

What each v1 key means is read from LLaMA-Factory's ``src/llamafactory/v1/config`` (its dataclasses and defaults)
and the plugins they name; ``docs/from-llamafactory.md`` has the table for users.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from shardtune.config.compat import Refused, translate_keys

V1_PREFIX = "LLaMA-Factory v1 format"
Section = Mapping[str, Any]
SectionTranslate = Callable[[Section], dict[str, Any]]

# Keys that only a v1 file has: one of them makes the file a v1 file. (cp_size and cp_mode are v1's too, but a v0
# file may borrow them for sequence parallelism: config/compat.py maps them in either format.)
V1_ONLY_KEYS = frozenset({
    "model", "model_class", "custom_chat_template", "init_config", "peft_config", "kernel_config", "quant_config",
    "train_dataset", "micro_batch_size", "global_batch_size", "batching_strategy", "batching_workers",
    "enable_activation_checkpointing", "dist_config", "dp_size", "mp_replicate_size",
    "mp_shard_size", "dist_timeout", "optim_config", "lr_scheduler_config", "save_epochs", "save_ckpt_as_hf",
    "sample_backend",
})

# v1 keys spelled as shardtune spells them, with the same meaning: passed through unchanged.
SAME_NAME = ("trust_remote_code", "output_dir", "cutoff_len", "learning_rate", "num_train_epochs", "max_steps",
             "max_grad_norm", "bf16", "seed", "resume_from_checkpoint", "save_steps", "save_total_limit",
             "logging_steps", "pref_loss", "pref_beta", "pref_ftx", "simpo_gamma", "dpo_label_smoothing", "ld_alpha",
             "max_new_tokens")

# Where v1's defaults differ from shardtune's (v1 config dataclasses; AdamW's own weight decay; a constant learning
# rate when no lr_scheduler_config; the model's chat template; no checkpoints unless save_steps is given).
V1_DEFAULTS: dict[str, Any] = {
    "finetuning_type": "full", "bf16": True, "learning_rate": 1e-4, "cutoff_len": 2048, "gradient_checkpointing": True,
    "logging_steps": 1, "weight_decay": 0.01, "lr_scheduler_type": "constant", "template": "auto",
    "save_strategy": "no",
}


def is_v1_file(values: Mapping[str, Any]) -> bool:
    """True when ``values`` (a file's top-level keys) carry a key only LLaMA-Factory's v1 format has."""
    return any(key in V1_ONLY_KEYS for key in values)


def v1_problem(key: str, value: Any, reason: str) -> Refused:
    """A v1 setting shardtune cannot honour: the message starts by naming the v1 format."""
    refused = Refused(key, value, reason)
    refused.args = (f"{V1_PREFIX}: {refused.args[0]}",)
    return refused


def translate_v1(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A v1 file's values in shardtune's (and LLaMA-Factory v0's) spelling, with v1's defaults; (values, problems).
    Keys that are not v1 keys pass through unchanged for the usual checks."""
    given, problems = _translate_given(values)
    return {**v1_defaults_left(given), **given}, problems


def v1_defaults_left(given: Mapping[str, Any]) -> dict[str, Any]:
    """v1's defaults for the shardtune keys that a v1 file's translated values (``given``) do not set."""
    return {key: value for key, value in V1_DEFAULTS.items() if key not in given}


def _translate_given(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    result: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in values.items():
        try:
            produced = _translate_key(str(key), value, values)
        except ValueError as err:
            problems.append(str(err))
            continue
        for target, new in produced.items():
            if target in result and result[target] != new:
                problems.append(f"{V1_PREFIX}: key '{key}' sets {target} to {new!r}, another key to "
                                f"{result[target]!r}; keep one")
            result[target] = new
    if "save_steps" in result:
        result.setdefault("save_strategy", "steps")
    return result, problems


def _translate_key(key: str, value: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    if key in SAME_NAME:
        return {key: value}
    if key in FLAT:
        return FLAT[key](value, values)
    if key in SECTIONS:
        return _section(key, value, SECTIONS[key])
    if key in V1_PLAIN_REFUSED:
        raise v1_problem(key, value, V1_PLAIN_REFUSED[key])
    return {key: value}  # not a v1 key: the schema judges it (a v0 key, or unknown with its hint)


def _section(key: str, value: Any, by_name: Mapping[str, SectionTranslate]) -> dict[str, Any]:
    """A plugin section: null means the plugin is off; otherwise its ``name`` picks the translation."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or "name" not in value:
        raise ValueError(f"{V1_PREFIX}: key '{key}' must be a mapping with a 'name' (as v1's plugin configs are), "
                         f"got {value!r}")
    name = str(value["name"]).strip()
    if name not in by_name:
        reason = SECTION_REFUSED_ANY.get(key) or (
            f"{key} name '{name}' has no counterpart in shardtune; choose one of: {', '.join(by_name)}")
        raise v1_problem(f"{key}.name", name, reason)
    return by_name[name]({k: v for k, v in value.items() if k != "name"})


def _settings(section: str, given: Section, rename: Mapping[str, str],
              fixed: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A section's settings: each renamed into a shardtune key, or (``fixed``) accepted at the one value shardtune
    does anyway (None always accepted: the plugin's default); any other setting is refused, naming it."""
    fixed = fixed or {}
    result: dict[str, Any] = {}
    for name, value in given.items():
        if name in rename:
            if value is not None:
                result[rename[name]] = value
        elif name in fixed and value in (None, fixed[name]):
            continue
        else:
            what = (f"shardtune does what {name}: {fixed[name]!r} does and nothing else" if name in fixed
                    else f"no counterpart in shardtune (it reads: {', '.join([*rename, *fixed]) or 'nothing'})")
            raise v1_problem(f"{section}.{name}", value, f"{what}; remove it")
    return result


# --- flat keys under another name ---
def _model_class(value: Any, _values: Section) -> dict[str, Any]:
    if str(value).strip().lower() == "llm":
        return {}
    raise v1_problem("model_class", value, "shardtune trains causal language models (model_class: llm); for a "
                                           "reward model use the v0 keys with stage: rm")


def _flash_attn(value: Any, _values: Section) -> dict[str, Any]:
    choices = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash_attention_2"}
    if str(value) not in choices:
        raise ValueError(f"{V1_PREFIX}: flash_attn {value!r} is not allowed; choose one of: {', '.join(choices)}")
    return {"attn_implementation": choices[str(value)]}


def _off_at(accepted: Any, key: str, reason: str) -> Callable[[Any, Section], dict[str, Any]]:
    """A v1 key whose ``accepted`` value (or null) is what shardtune does; another value is refused."""
    def translate(value: Any, _values: Section) -> dict[str, Any]:
        if value is None or value == accepted:
            return {}
        raise v1_problem(key, value, reason)
    return translate


def _rename(target: str) -> Callable[[Any, Section], dict[str, Any]]:
    return lambda value, _values: {target: value}


def _batching(value: Any, values: Section) -> dict[str, Any]:
    """v1's dynamic strategies fill each micro-batch up to ``cutoff_len x micro_batch_size`` tokens (its
    ``plugins/trainer_plugins/batching.py``): shardtune's ``micro_batch_tokens``, with padding-free rows for
    ``dynamic_padding_free``."""
    choice = str(value).strip()
    # v1's defaults: cutoff_len 2048, micro_batch_size 1
    tokens = int(values.get("cutoff_len") or V1_DEFAULTS["cutoff_len"]) * int(values.get("micro_batch_size") or 1)
    translations: dict[str, dict[str, Any]] = {
        "normal": {}, "padding_free": {"padding_free": True}, "dynamic_batching": {"micro_batch_tokens": tokens},
        "dynamic_padding_free": {"micro_batch_tokens": tokens, "padding_free": True}}
    if choice not in translations:
        raise v1_problem("batching_strategy", value, f"v1's strategies are {', '.join(translations)}")
    return translations[choice]


def _save_epochs(value: Any, _values: Section) -> dict[str, Any]:
    if value is None:
        return {}
    if float(value) == 1:
        return {"save_strategy": "epoch"}
    raise v1_problem("save_epochs", value, "shardtune saves every epoch (save_epochs: 1) or every save_steps steps")


def _train_dataset(value: Any, values: Section) -> dict[str, Any]:
    """A v1 dataset file is the registry (``dataset_dir``; data/lf_v1_data.py reads it); every dataset it names
    is trained on, as v1 does."""
    path = Path(str(value))
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise v1_problem("train_dataset", value, "shardtune reads a v1 dataset file (YAML naming local jsonl files); "
                                                 "a data file or hub id given directly is not read: list it in one")
    try:
        names = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{V1_PREFIX}: train_dataset {str(value)!r} cannot be read: {err}") from None
    if not isinstance(names, dict) or not names:
        raise ValueError(f"{V1_PREFIX}: train_dataset {str(value)!r} must map dataset names to entries")
    return {"dataset_dir": str(value), "dataset": [str(name) for name in names],
            **_pair_stage(str(value), names, "stage" in values)}


V1_PAIR_KEYS = frozenset({"chosen_messages", "rejected_messages"})  # v1's DPOSample (data/lf_v1_data.py reads it)


def _pair_stage(where: str, entries: Mapping[Any, Any], stage_given: bool) -> dict[str, Any]:
    """v1 picks the stage from its command (``llamafactory-cli dpo``), a file never names it: datasets of pairs
    (``chosen_messages``/``rejected_messages``) are trained with stage dpo, as that command would, unless the file
    sets ``stage`` (rm trains on the same pairs). data/lf_v1_data.py reads the pairs."""
    pairs = {str(name): _first_record_is_pair(entry) for name, entry in entries.items()}
    if stage_given or not any(pairs.values()):
        return {}
    if not all(pairs.values()):
        raise ValueError(f"{V1_PREFIX}: train_dataset {where!r} mixes preference pairs "
                         f"({', '.join(n for n, p in pairs.items() if p)}) with conversations "
                         f"({', '.join(n for n, p in pairs.items() if not p)}); v1 trains one kind per command: "
                         "list one kind in the file")
    return {"stage": "dpo"}


def _first_record_is_pair(entry: Any) -> bool:
    """Whether a v1 dataset entry's file (JSON lines, relative to the working directory as v1 reads it) starts with
    one of v1's pairs; a file that cannot be read is judged by the data checks."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("path"), str) or entry.get("converter"):
        return False
    try:
        with Path(entry["path"]).open(encoding="utf-8") as handle:
            record = json.loads(next((line for line in handle if line.strip()), "null"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(record, dict) and "messages" not in record and V1_PAIR_KEYS <= set(record)


FLAT: dict[str, Callable[[Any, Section], dict[str, Any]]] = {
    "model": _rename("model_name_or_path"),
    "train_dataset": _train_dataset,
    "model_class": _model_class,
    "flash_attn": _flash_attn,
    "micro_batch_size": _rename("per_device_train_batch_size"),
    "batching_strategy": _batching,
    "batching_workers": _rename("dataloader_num_workers"),
    "enable_activation_checkpointing": _rename("gradient_checkpointing"),
    "dist_timeout": _rename("ddp_timeout"),
    "save_epochs": _save_epochs,
    "dp_size": _off_at(None, "dp_size", "shardtune's data-parallel size is the number of processes (NNODES x "
                                        "NPROC_PER_NODE) divided by sequence_parallel_size (cp_size); remove it"),
    "mp_replicate_size": _off_at(1, "mp_replicate_size", "replicated shard groups are fsdp: hybrid_shard in "
                                                         "shardtune; remove it and use that"),
    "mp_shard_size": _off_at(None, "mp_shard_size", "FSDP shards over all processes (or one node with fsdp: "
                                                    "hybrid_shard); remove it"),
    "full_determinism": _off_at(False, "full_determinism", "shardtune seeds every rank with `seed` but does not "
                                                           "switch torch to deterministic kernels; remove it"),
    "save_ckpt_as_hf": _off_at(False, "save_ckpt_as_hf", "shardtune's checkpoints hold engine state for resuming; "
                                                         "the final model is written in Hugging Face format, and "
                                                         "`shardtune export` turns any checkpoint into one"),
    "sample_backend": _off_at("hf", "sample_backend", "shardtune's chat and predictions run on transformers (hf); "
                                                      "serve the exported model with vLLM yourself"),
}

V1_PLAIN_REFUSED = {
    "custom_chat_template": "shardtune reads a chat template from the tokenizer (template: auto) or its named "
                            "templates; put the jinja text into tokenizer_config.json's chat_template instead",
    "global_batch_size": "shardtune's global batch is per_device_train_batch_size x gradient_accumulation_steps x "
                         "processes; give gradient_accumulation_steps instead",
    "eval_dataset": "evaluation on a second v1 dataset file is not read by shardtune; hold out part of the training "
                    "data with val_size, or register both in a dataset_info.json (dataset, eval_dataset)",
}


# --- plugin sections: name -> translation of its settings ---
def _lora(given: Section) -> dict[str, Any]:
    return {"finetuning_type": "lora", **_settings("peft_config", given, {
        "r": "lora_rank", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "target_modules": "lora_target",
        "adapter_name_or_path": "adapter_name_or_path", "export_dir": "export_dir", "export_size": "export_size",
        "infer_dtype": "infer_dtype"})}


def _freeze(given: Section) -> dict[str, Any]:
    return {"finetuning_type": "freeze", **_settings("peft_config", given, {
        "freeze_trainable_layers": "freeze_trainable_layers", "freeze_trainable_modules": "freeze_trainable_modules",
        "freeze_extra_modules": "freeze_extra_modules"})}


def _bnb(given: Section) -> dict[str, Any]:
    return {"quantization_method": "bnb", **_settings("quant_config", given, {"quantization_bit": "quantization_bit"})}


def _fsdp2(given: Section) -> dict[str, Any]:
    return {"fsdp": "full_shard", **_settings("dist_config", given, {}, fixed={"dcp_path": None})}


def _fsdpturbo(given: Section) -> dict[str, Any]:
    """v1's FSDPTurbo plugin: FSDP2 whose MoE experts are split over ``ep_size`` ranks (expert parallelism, tokens
    sent to their experts' rank by an all-to-all): shardtune's FSDP2 with ``expert_parallel_size``."""
    ep_size = given.get("ep_size")
    if ep_size is not None and (isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1):
        raise v1_problem("dist_config.ep_size", ep_size, "ep_size must be a whole number of ranks, 1 or more")
    rest = {k: v for k, v in given.items() if k != "ep_size"}
    experts = {"expert_parallel_size": ep_size} if ep_size is not None else {}
    return {"fsdp": "full_shard", **experts, **_settings("dist_config", rest, {}, fixed={
        "dcp_path": None, "ep_dispatcher": "eager", "fsdp_implementation": "native", "reshard_after_forward": True,
        "offload_params": False, "pin_memory": True, "fsdp_ignored_modules": [], "hook_modules": []})}


def _deepspeed(given: Section) -> dict[str, Any]:
    return _settings("dist_config", given, {"config_file": "deepspeed"})


def _muon(given: Section) -> dict[str, Any]:
    # torch.optim.Muon's defaults, which shardtune's Muon uses, are v1's muon defaults too.
    return {"use_muon": True, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, **_muon_settings(given)}


def _muon_settings(given: Section) -> dict[str, Any]:
    betas = given.get("adamw_betas")
    rest = {k: v for k, v in given.items() if k != "adamw_betas"}
    result = _settings("optim_config", rest, {"wd": "weight_decay", "adamw_eps": "adam_epsilon"},
                       fixed={"momentum": 0.95, "nesterov": True, "ns_steps": 5})
    if betas is not None:
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError(f"{V1_PREFIX}: optim_config.adamw_betas must be two numbers, got {betas!r}")
        result.update(adam_beta1=betas[0], adam_beta2=betas[1])
    return result


def _nothing(section: str) -> SectionTranslate:
    """A plugin whose choice changes how, not what, is computed: accepted when it has no settings."""
    return lambda given: _settings(section, given, {})


FLA_KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


def _flash_linear_attention(given: Section) -> dict[str, Any]:
    """v1's flash-linear-attention plugin: fla's gated-delta-rule kernels in the linear-attention layers (Qwen3.5,
    Qwen3-Next). transformers calls the same two kernels itself when the fla package is installed (its torch code
    otherwise), at fla's chunk size 64, so the plugin's settings are accepted where they ask for that."""
    chunk_size = given.get("chunk_size")
    if chunk_size not in (None, 64):
        raise v1_problem("kernel_config.chunk_size", chunk_size, "transformers runs fla's chunked kernel at its "
                         "chunk size 64; use 64 or remove it")
    include = given.get("include_kernels", "auto")
    names = FLA_KERNELS if include in ("auto", True, None) else [n.strip() for n in str(include).split(",")]
    unknown = [name for name in names if name not in FLA_KERNELS]
    if unknown:
        raise v1_problem("kernel_config.include_kernels", include, f"flash-linear-attention's kernels are "
                         f"{', '.join(FLA_KERNELS)} (transformers calls both where fla is installed); remove "
                         f"{', '.join(unknown)}")
    return _settings("kernel_config", {k: v for k, v in given.items() if k not in ("chunk_size", "include_kernels")},
                     {})


def _liger(given: Section) -> dict[str, Any]:
    # use_kernels: auto is each Liger patch's defaults, which shardtune applies (its loss switches aside).
    return {**_settings("kernel_config", given, {}, fixed={"use_kernels": "auto"}), "enable_liger_kernel": True}


SECTIONS: dict[str, dict[str, SectionTranslate]] = {
    "peft_config": {"lora": _lora, "freeze": _freeze},
    "quant_config": {"bnb": _bnb, "auto": _bnb},  # auto picks bnb for a model that is not pre-quantized
    "dist_config": {"fsdp2": _fsdp2, "fsdpturbo": _fsdpturbo, "deepspeed": _deepspeed},
    # Loading places the weights; the engine shards them the same way whichever loader ran.
    "init_config": {name: _nothing("init_config") for name in ("init_on_meta", "init_on_rank0", "init_on_default")},
    # `auto` applies the fused kernels found installed; they compute what the model's modules compute.
    # liger_kernel: Liger's RMSNorm, RoPE and MLP kernels on the loaded model (model/liger.py), as v1's plugin.
    # flash-linear-attention: transformers' own choice of kernel for gated-delta-rule layers (fla when installed).
    "kernel_config": {"auto": _nothing("kernel_config"), "liger_kernel": _liger,
                      "flash-linear-attention": _flash_linear_attention,
                      "auto, flash-linear-attention": _flash_linear_attention},
    "optim_config": {"muon": _muon},
    "lr_scheduler_config": {},
}

# A section every one of whose names is refused, for this reason.
SECTION_REFUSED_ANY = {
    "lr_scheduler_config": "v1 registers no scheduler plugin (its runs keep the learning rate constant); give "
                           "lr_scheduler_type (cosine, linear, ...) with warmup_ratio or warmup_steps instead",
}


def translate_file_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A config file's values in shardtune's spelling, whichever LLaMA-Factory format it is written in (v1 first
    into v0 spelling, then ``compat``'s flat spellings); (values, problems), the v1 problems first."""
    if not is_v1_file(values):
        return translate_keys(values)
    flat, v1_problems = translate_v1(values)
    translated, problems = translate_keys(flat)
    return translated, v1_problems + problems


def v1_defaults_for_file(values: Mapping[str, Any]) -> dict[str, Any]:
    """The v1 defaults a v1 file relies on (for ``convert-config``'s first line)."""
    return v1_defaults_left(_translate_given(values)[0])


def describe_v1_key(key: str, values: Mapping[str, Any]) -> tuple[bool, str] | None:
    """For ``convert-config``: (refused, what the v1 key becomes or why it is refused); None for a key that is not
    a v1 key (the usual report applies)."""
    if key in SAME_NAME or key not in (*FLAT, *SECTIONS, *V1_PLAIN_REFUSED):
        return None
    try:
        produced = _translate_key(key, values[key], values)
    except Refused as refused:
        return True, refused.args[0]
    except ValueError as err:
        return True, str(err)
    shown = ", ".join(f"{target}: {value!r}" for target, value in produced.items()) or "nothing (what shardtune does)"
    return False, f"-> {shown}"
