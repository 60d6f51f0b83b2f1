"""Rules that span several keys or look at files, run on the launching host before any work starts."""

from __future__ import annotations

import os
from pathlib import Path

from shardtune import run_files
from shardtune.config.adapter_method import adapter_targets, is_adapter_type
from shardtune.config.batching import micro_batch_tokens_problems
from shardtune.config.generation import generation_key_problems, predicts_only
from shardtune.config.grpo import grpo_problems
from shardtune.config.preference import PREFERENCE_STAGES, split_paths, uses_reference
from shardtune.config.schema import REPORT_TO, TrainConfig
from shardtune.data.settings import VARLEN
from shardtune.data.tokenized import is_saved
from shardtune.errors import ConfigError, ModelError
from shardtune.infer.metrics import score_package_problems
from shardtune.launch.model_checks import attention_problems, layer_problems, moe_problems, position_problems
from shardtune.launch.optimizer_checks import badam_layer_problems, optimizer_key_problems
from shardtune.launch.write_guard import write_problems
from shardtune.model.depth_checks import depth_checkpoint_problems
from shardtune.model.finetuning.oft import size_problem
from shardtune.model.folder import is_reward_model_config, model_config_json, model_folder_problems
from shardtune.model.fp8 import float8_key_problems
from shardtune.model.load import offline_hub_problems
from shardtune.model.tiny import tiny_model_build_problem
from shardtune.paths import folder_problem, reads_as_hub_id, shown
from shardtune.train.checkpoint_folders import checkpoint_problems, latest_checkpoint, resume_source
from shardtune.train.settings import resolved_packing
from shardtune.train.trackers import tracker_problems


def validate_config(config: TrainConfig, *, check_files: bool = True) -> None:
    """Raise one ConfigError listing every cross-key problem (and file problems when asked)."""
    problems = cross_key_problems(config)
    if check_files:
        problems += file_problems(config)
    if problems:
        raise ConfigError(*problems)


def cross_key_problems(c: TrainConfig) -> list[str]:
    """Combinations of keys that cannot work, each naming both keys and their values."""
    problems: list[str] = []
    if c.model_name_or_path is None:
        problems.append("model_name_or_path is required (a local model directory or a hub id)")
    if c.output_dir is None:
        problems.append("output_dir is required (where the model and logs are written)")
    if not c.dataset and not (c.tokenized_path and is_saved(c.tokenized_path)) and not predicts_only(c):
        problems.append("dataset is required (names from dataset_info.json, comma separated), unless "
                        "tokenized_path holds datasets prepared by an earlier run")
    problems += generation_key_problems(c) + score_package_problems(c)
    if c.bf16 and c.fp16:
        problems.append("bf16 (true) and fp16 (true) are both set; choose one")
    if c.pure_bf16 and (c.fp16 or c.quantization_bit is not None):
        problems.append(f"pure_bf16 (true) with fp16 ({str(c.fp16).lower()}) / quantization_bit "
                        f"({c.quantization_bit}): pure_bf16 trains every weight in bfloat16; remove the others")
    if c.max_steps <= 0 and c.num_train_epochs <= 0:
        problems.append(f"max_steps ({c.max_steps}) and num_train_epochs ({c.num_train_epochs}): one must be > 0")
    if c.quantization_bit is not None and not is_adapter_type(c.finetuning_type):
        problems.append(f"quantization_bit ({c.quantization_bit}) needs finetuning_type: lora or oft "
                        f"(got '{c.finetuning_type}'); quantized weights cannot be trained directly")
    if (c.do_eval or c.eval_strategy != "no") and c.val_size <= 0 and not c.eval_dataset:
        problems.append(f"do_eval/eval_strategy ({c.eval_strategy}) needs val_size > 0 to hold out eval data, or "
                        "eval_dataset naming the eval datasets")
    if c.val_size >= 1 and not float(c.val_size).is_integer():
        problems.append(f"val_size ({c.val_size}): use a fraction below 1 or a whole number of samples")
    bad_trackers = [r for r in c.report_to if r not in REPORT_TO and r != "all"]
    if bad_trackers:
        problems.append(f"report_to: unknown tracker(s) {bad_trackers}; choose from {', '.join(REPORT_TO)}")
    problems += tracker_problems(c.report_to) + offline_hub_problems(c.model_name_or_path,
                                                                     c.build_tiny_model_if_missing)
    if c.engine == "auto" and (c.deepspeed or c.fsdp or c.fsdp_config):
        problems.append("engine (auto) with deepspeed/fsdp set: let the estimate choose, or remove engine: auto")
    problems += schedule_problems(c)
    problems += _lora_target_problems(c)
    problems += oft_key_problems(c)
    problems += model_key_problems(c)
    problems += _adapter_problems(c)
    problems += streaming_key_problems(c)
    problems += micro_batch_tokens_problems(c)
    problems += optimizer_key_problems(c)
    problems += preference_key_problems(c) + grpo_problems(c)
    problems += token_weighting_problems(c)
    problems += float8_key_problems(c)
    problems += checkpoint_key_problems(c)
    return problems


def checkpoint_key_problems(c: TrainConfig) -> list[str]:
    """``async_save`` stages the engine's resume state; a model-only checkpoint is Hugging Face files written by
    ``save_pretrained`` at once, which it cannot stage."""
    if c.async_save and c.save_only_model and c.save_strategy != "no":
        return ["async_save (true) with save_only_model (true): a model-only checkpoint is written in Hugging Face "
                "format at once (save_pretrained), which async_save cannot stage; remove one of them"]
    return []


def token_weighting_problems(c: TrainConfig) -> list[str]:
    """use_dft_loss / use_eaft_loss / use_asft_loss reweight the sft/pt token loss; one at a time, and not on smoothed
    targets; ASFT's reference is the model as loaded (``asft_reference_problems``)."""
    chosen = [key for key in ("use_dft_loss", "use_eaft_loss", "use_asft_loss") if getattr(c, key)]
    problems = []
    if len(chosen) > 1:
        problems.append(f"{' and '.join(f'{key} (true)' for key in chosen)} each reweight the token loss; choose one")
    if chosen and c.stage not in ("sft", "pt"):
        problems.append(f"{chosen[0]} (true) reweights the sft/pt token loss; stage {c.stage} has its own loss: "
                        "remove it")
    if chosen and c.label_smoothing_factor > 0:
        problems.append(f"{chosen[0]} (true) with label_smoothing_factor ({c.label_smoothing_factor}): the weight is "
                        "the target's own probability or entropy, not a smoothed target's; remove one")
    for key, switch in (("eaft_alpha", "use_eaft_loss"), ("asft_alpha", "use_asft_loss")):
        if getattr(c, key) != getattr(TrainConfig, key) and not getattr(c, switch):
            problems.append(f"{key} ({getattr(c, key)}) is read with {switch}: true only; set it or remove {key}")
    return problems + asft_reference_problems(c)


def asft_reference_problems(c: TrainConfig) -> list[str]:
    """ASFT anchors to the model as loaded; a LoRA/OFT run's reference is the policy with its adapters off (unless
    ref_model is given), so whatever changes that model's forward would move the anchor too."""
    if not c.use_asft_loss or c.ref_model is not None or not is_adapter_type(c.finetuning_type):
        return []
    problems = []
    if c.neftune_noise_alpha:
        problems.append(f"neftune_noise_alpha ({c.neftune_noise_alpha}) with use_asft_loss (true) and finetuning_type "
                        f"{c.finetuning_type}: the reference is the model with its adapters off, whose embeddings "
                        "would get the noise too; remove neftune_noise_alpha")
    if c.pissa_init and c.finetuning_type == "lora":
        problems.append("pissa_init (true) with use_asft_loss (true): the reference is the model with its adapters "
                        "off, which after PiSSA is the residual of the weights, not the original model; use plain "
                        "LoRA initialisation")
    return problems


def schedule_problems(c: TrainConfig) -> list[str]:
    """Numbers that are valid alone but say nothing sensible together: a warm-up that never ends, a layer count
    that selects nothing."""
    problems = []
    if 0 < c.max_steps <= c.warmup_steps:
        problems.append(f"warmup_steps ({c.warmup_steps}) is not below max_steps ({c.max_steps}): the learning rate "
                        "would never reach learning_rate; lower warmup_steps")
    if c.use_llama_pro and c.finetuning_type not in ("freeze", "lora"):
        problems.append(f"use_llama_pro (true) trains the expanded blocks under finetuning_type freeze or lora, not "
                        f"{c.finetuning_type}; choose one of those")
    if c.mixture_of_depths and c.finetuning_type != "full":
        problems.append(f"mixture_of_depths ({c.mixture_of_depths}) trains its new routers in full, beside every "
                        f"weight; use finetuning_type: full (not {c.finetuning_type})")
    if c.mixture_of_depths and c.attn_implementation == VARLEN:
        problems.append(f"mixture_of_depths ({c.mixture_of_depths}) with attn_implementation varlen: the router hides "
                        "the tokens it skips with the attention mask, which varlen does not take; use sdpa or eager")
    if c.mixture_of_depths and resolved_packing(c):
        problems.append(f"mixture_of_depths ({c.mixture_of_depths}) with packing (on for stage pt unless set): the "
                        "router ranks the tokens of a row, and a packed row holds several samples; set packing: false")
    if c.finetuning_type == "freeze" and c.freeze_trainable_layers == 0:
        problems.append("freeze_trainable_layers (0) selects no layer to train; give N > 0 (the last N decoder "
                        "layers) or -N (the first N)")
    if c.warmup_ratio >= 1 and c.warmup_steps == 0:
        problems.append(f"warmup_ratio ({c.warmup_ratio}) warms up over the whole run: the learning rate would never "
                        "reach learning_rate; use a fraction below 1 (e.g. 0.1)")
    return problems


# Preference keys, and the stages (and dpo losses) that read them; set elsewhere they would be ignored.
PREFERENCE_KEY_USERS = {"pref_beta": ("dpo", "kto"), "pref_loss": ("dpo",), "pref_ftx": ("dpo",),
                        "simpo_gamma": ("dpo",), "dpo_label_smoothing": ("dpo",), "kto_chosen_weight": ("kto",),
                        "kto_rejected_weight": ("kto",)}


def preference_key_problems(c: TrainConfig) -> list[str]:
    """Preference keys that the stage would not read, and what the preference stages do not do yet."""
    defaults = TrainConfig()
    problems = [f"{key} ({getattr(c, key)}) is read by stage {' or '.join(stages)} only, but stage is {c.stage}; "
                "remove it or change the stage" for key, stages in PREFERENCE_KEY_USERS.items()
                if getattr(c, key) != getattr(defaults, key) and c.stage not in stages]
    if c.stage == "dpo" and c.simpo_gamma != defaults.simpo_gamma and c.pref_loss != "simpo":
        problems.append(f"simpo_gamma ({c.simpo_gamma}) is read by pref_loss simpo only (pref_loss is {c.pref_loss}); "
                        "remove it")
    if c.stage == "dpo" and c.dpo_label_smoothing > 0 and c.pref_loss != "sigmoid":
        problems.append(f"dpo_label_smoothing ({c.dpo_label_smoothing}) applies to pref_loss sigmoid only (pref_loss "
                        f"is {c.pref_loss}); remove it")
    problems += ref_model_problems(c)
    if c.precompute_ref_log_probs and not uses_reference(c):
        problems.append(f"precompute_ref_log_probs (true) is for stage dpo/kto with a reference (stage {c.stage}"
                        + (f", pref_loss {c.pref_loss}" if c.stage == "dpo" else "") + "); remove it")
    problems += reward_model_problems(c)
    if c.stage not in PREFERENCE_STAGES:
        return problems
    if c.train_on_prompt or c.mask_history:
        problems.append(f"train_on_prompt ({str(c.train_on_prompt).lower()}) / mask_history "
                        f"({str(c.mask_history).lower()}): stage {c.stage} scores only the final answer (earlier turns "
                        "and the prompt are always context), so they would have no effect; remove them")
    if c.neftune_noise_alpha and c.stage in ("dpo", "kto"):
        problems.append(f"neftune_noise_alpha ({c.neftune_noise_alpha}) with stage {c.stage}: the noise would also "
                        "reach the reference's forward; remove it")
    if c.pissa_init and c.stage in ("dpo", "kto") and c.finetuning_type == "lora":
        problems.append(f"pissa_init (true) with stage {c.stage}: the reference is the model with its adapters "
                        "off, which after PiSSA is the residual of the weights, not the original model; use plain "
                        "LoRA initialisation")
    if c.label_smoothing_factor > 0:
        problems.append(f"label_smoothing_factor ({c.label_smoothing_factor}) smooths the SFT cross entropy; stage "
                        f"{c.stage} scores answers by their log-probabilities: remove it (dpo: dpo_label_smoothing)")
    return problems


def reward_model_problems(c: TrainConfig) -> list[str]:
    """Training starts from a causal LM: a reward model folder would load without its score layer (transformers
    drops it and draws a new output layer), and so would stage rm's model-only checkpoints on resume."""
    problems = []
    try:
        config = model_config_json(c.model_name_or_path)
    except ModelError:
        config = None  # reported by the folder checks
    if is_reward_model_config(config):
        problems.append(f"model_name_or_path: {c.model_name_or_path} is a reward model (a sequence-classification "
                        "class in its config.json), which loads here without its score layer; give the causal LM it "
                        "was trained from (stage rm puts it under a new score head)")
    if c.stage == "rm" and c.save_only_model:
        problems.append("save_only_model (true) with stage rm: a model-only checkpoint resumes through the causal-LM "
                        "loader, which would drop the trained score layer; remove it (checkpoints then hold the "
                        "engine's whole state)")
    return problems


def ref_model_problems(c: TrainConfig) -> list[str]:
    """``ref_model`` (and its adapters and quantization): a local model folder (or one in the hub cache) whose
    vocabulary is the policy's, read by a run that has a live reference. Engines refuse what they cannot place
    (engines/spec.py ``preference_problems``; the CUDA rule of its quantization: engines/plan.py)."""
    if c.ref_model is None:
        return [f"{key} ({getattr(c, key)}) applies to ref_model, which is not set; set ref_model or remove it"
                for key in ("ref_model_adapters", "ref_model_quantization_bit") if getattr(c, key) is not None]
    if not uses_reference(c) and not c.use_asft_loss:
        return [f"ref_model ({c.ref_model}) is read by stage dpo (a loss with a reference), kto or use_asft_loss "
                f"only (stage {c.stage}" + (f", pref_loss {c.pref_loss}" if c.stage == "dpo" else "") + "); remove it"]
    problems = []
    if c.precompute_ref_log_probs:
        problems.append("precompute_ref_log_probs (true) with ref_model: the first pass scores the data with the "
                        "untrained policy, not ref_model; remove one of them")
    if c.resize_vocab or c.add_tokens or c.add_special_tokens:
        problems.append("resize_vocab/add_tokens/add_special_tokens with ref_model: the policy's vocabulary grows "
                        "and ref_model's would not; remove ref_model (the reference is then the policy as loaded)")
    problems += _ref_folder_problems(c)
    problems += [p for p in (adapter_folder_problem("ref_model_adapters", path)
                             for path in split_paths(c.ref_model_adapters)) if p]
    return problems


def _ref_folder_problems(c: TrainConfig) -> list[str]:
    from shardtune.model.folder import weights_problems

    folder = Path(c.ref_model or "")
    if folder.exists() and not folder.is_dir():
        return [f"ref_model: {c.ref_model} is a file; give the model folder (the one holding config.json) or a hub id"]
    try:
        ref, policy = model_config_json(c.ref_model), model_config_json(c.model_name_or_path)
    except ModelError as err:
        return [f"ref_model: {err}"]
    if ref is None:
        return [f"ref_model: {c.ref_model} is neither a model folder with a config.json nor a model in the Hugging "
                "Face cache"]
    problems = [f"ref_model: {p}" for p in weights_problems(folder)] if folder.is_dir() else []
    if policy is not None and ref.get("vocab_size") != policy.get("vocab_size"):
        problems.append(f"ref_model: {c.ref_model} has vocab_size {ref.get('vocab_size')} and model_name_or_path "
                        f"{policy.get('vocab_size')}: the reference scores the same token ids, so both need the same "
                        "tokenizer and vocabulary")
    return problems


def streaming_key_problems(c: TrainConfig) -> list[str]:
    """Training keys that need the data's length, which a stream does not know (val_size: data.checks)."""
    if not c.streaming:
        return []
    problems = []
    if c.max_steps <= 0:
        problems.append(f"streaming (true) needs max_steps > 0 (got {c.max_steps}): a stream has no length, so "
                        f"num_train_epochs ({c.num_train_epochs}) cannot be turned into steps; set max_steps")
    if c.group_by_length:
        problems.append("group_by_length (true) with streaming (true): grouping needs every sample's length up "
                        "front; unset group_by_length (or streaming)")
    if c.tokenized_path:
        problems.append(f"tokenized_path ({c.tokenized_path}) with streaming (true): a stream is tokenised on the "
                        "fly and never saved; unset one")
    for key, value in (("save_strategy", c.save_strategy), ("eval_strategy", c.eval_strategy)):
        if value == "epoch":
            problems.append(f"{key} (epoch) with streaming (true): a stream's epoch has no known number of steps; "
                            f"use {key}: steps")
    return problems


CHECKPOINT_ARGUMENTS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug")


def model_key_problems(c: TrainConfig) -> list[str]:
    """Adapters, quantization and checkpointing keys that cannot work together (LLaMA-Factory's rules)."""
    problems: list[str] = []
    adapters = c.adapter_name_or_path
    if adapters and not is_adapter_type(c.finetuning_type):
        problems.append(f"adapter_name_or_path ({','.join(adapters)}) needs finetuning_type: lora or oft (got "
                        f"'{c.finetuning_type}'); merge the adapters into the model first (shardtune export)")
    if adapters and c.quantization_bit is not None and (len(adapters) > 1 or c.create_new_adapter):
        problems.append(f"adapter_name_or_path ({len(adapters)} adapter(s), create_new_adapter: "
                        f"{str(c.create_new_adapter).lower()}) with quantization_bit ({c.quantization_bit}): adapters "
                        "cannot be merged into quantized weights; merge them into the unquantized model first")
    if c.quantization_bit is not None and (c.resize_vocab or c.add_tokens or c.add_special_tokens):
        problems.append(f"resize_vocab/add_tokens/add_special_tokens with quantization_bit ({c.quantization_bit}): "
                        "the embedding of a quantized model cannot grow; add the tokens without quantization")
    if c.quantization_method != "bnb":
        problems.append(f"quantization_method ({c.quantization_method}): shardtune quantizes on load with bitsandbytes "
                        "only (bnb); a GPTQ/AWQ/... checkpoint that is already quantized is recognised from its "
                        "config.json without this key")
    unknown = sorted(set(c.gradient_checkpointing_kwargs or {}) - set(CHECKPOINT_ARGUMENTS))
    if unknown:
        problems.append(f"gradient_checkpointing_kwargs: unknown argument(s) {unknown}; torch.utils.checkpoint "
                        f"takes {', '.join(CHECKPOINT_ARGUMENTS)}")
    if c.gradient_checkpointing_kwargs and not c.gradient_checkpointing:
        problems.append("gradient_checkpointing_kwargs (or use_reentrant_gc) is set but gradient_checkpointing is "
                        "false, so it would have no effect; remove it or enable gradient_checkpointing")
    return problems


def _adapter_problems(c: TrainConfig) -> list[str]:
    """LoRA-only keys, PiSSA's needs and the loader's worker rules (as LLaMA-Factory and torch refuse them)."""
    problems = []
    lora_only = {"use_dora": c.use_dora, "use_rslora": c.use_rslora, "pissa_init": c.pissa_init,
                 "loraplus_lr_ratio": c.loraplus_lr_ratio}
    if c.finetuning_type != "lora":
        problems += [f"{key} ({value}) is only valid with finetuning_type: lora (got '{c.finetuning_type}')"
                     for key, value in lora_only.items() if value not in (False, None)]
    if c.additional_target is not None and not is_adapter_type(c.finetuning_type):
        problems.append(f"additional_target ({','.join(c.additional_target)}) is only valid with finetuning_type: "
                        f"lora or oft (got '{c.finetuning_type}')")
    if c.pissa_convert and not c.pissa_init:
        problems.append("pissa_convert (true) needs pissa_init: true (there is no PiSSA adapter to convert)")
    if c.pissa_init and c.quantization_bit is not None:
        problems.append(f"pissa_init (true) with quantization_bit ({c.quantization_bit}): PiSSA's SVD needs the "
                        "unquantized weights; remove one of them")
    if c.dataloader_persistent_workers and c.dataloader_num_workers == 0:
        problems.append("dataloader_persistent_workers (true) needs dataloader_num_workers > 0 (got 0)")
    return problems


def _lora_target_problems(c: TrainConfig) -> list[str]:
    key, targets = adapter_targets(c)
    if "all" in targets and len(targets) > 1:
        return [f"{key} ({','.join(targets)}): 'all' cannot be combined with module names"]
    return []


def oft_key_problems(c: TrainConfig) -> list[str]:
    """OFT's sizes (one of oft_rank / oft_block_size), and its keys set for another method."""
    if c.finetuning_type == "oft":
        problem = size_problem(c.oft_rank, c.oft_block_size)
        return [problem] if problem else []
    defaults = TrainConfig()
    return [f"{key} ({getattr(c, key)}) is only valid with finetuning_type: oft (got '{c.finetuning_type}')"
            for key in ("oft_rank", "oft_block_size", "oft_target", "module_dropout")
            if getattr(c, key) != getattr(defaults, key)]


def oft_size_problems(c: TrainConfig) -> list[str]:
    """The block size (or rank) against the in_features of each adapted layer, from config.json, as the ranks will
    build them; a model the estimate cannot read is left to the ranks' own check."""
    if c.finetuning_type != "oft" or size_problem(c.oft_rank, c.oft_block_size):
        return []
    from shardtune.estimate.adapter_shape import all_adapted_widths
    from shardtune.estimate.shape import shape_from_config
    from shardtune.model.attention import known_model_config
    from shardtune.model.finetuning.oft import OftSettings, divisor_problems

    known = known_model_config(c.model_name_or_path or "", builds_tiny_model=c.build_tiny_model_if_missing)
    try:
        widths = all_adapted_widths(shape_from_config(known or {}), c.oft_target)
    except ConfigError:
        return []  # no config.json here, or names the estimate does not know: the ranks check the built model
    return divisor_problems(widths, OftSettings(c.oft_rank, c.oft_block_size, c.module_dropout))


def mistyped_target_problems(c: TrainConfig) -> list[str]:
    """lora_target (oft_target) / additional_target names the model's weights lack, where a close name is present
    (a typo)."""
    from shardtune.model.weight_names import absent_modules, mistyped_modules

    folder = Path(c.model_name_or_path or "")
    problems = []
    target_key, targets = adapter_targets(c)
    for key, wanted in ((target_key, targets), ("additional_target", c.additional_target or [])):
        if key == target_key and (not is_adapter_type(c.finetuning_type) or "all" in wanted):
            continue
        typos = mistyped_modules(list(wanted), folder) if folder.is_dir() else {}
        problems += [f"{key}: {typed} not found in the model (did you mean '{close}'?)"
                     for typed, close in typos.items()]
        if folder.is_dir() and not is_mixture_of_experts(folder):  # as the rank refuses them, once loaded
            absent = [name for name in absent_modules([str(w) for w in wanted], folder) if name not in typos]
            problems += [f"{key}: {','.join(absent)} not found in the model; {ABSENT_REMEDY[key]}"] if absent else []
    return problems


# What the rank's own refusal of an absent name suggests (model/finetuning/targets.py).
ABSENT_REMEDY = {"additional_target": "use module names such as embed_tokens, lm_head, norm",
                 "lora_target": "use the model's linear modules (q_proj, v_proj, ...) or all",
                 "oft_target": "use the model's linear modules (q_proj, v_proj, ...) or all"}


def is_mixture_of_experts(folder: Path) -> bool:
    """Where transformers fuses the experts' stored weights into other modules on load (gate_up_proj), a module
    name may be missing from the stored names and still be the model's: left to the rank's check."""
    from shardtune.model.moe import expert_count

    config = model_config_json(str(folder)) or {}
    return expert_count(config) > 0


def file_problems(c: TrainConfig) -> list[str]:
    """Paths that must exist before training: the model's config and the output folder's state."""
    problems: list[str] = []
    model = c.model_name_or_path
    builds_model = model is not None and c.build_tiny_model_if_missing and not Path(model).exists()
    if builds_model:
        problems += [p for p in [tiny_model_build_problem(model or "")] if p]
    elif model is not None:
        model_problems = model_path_problems(model)
        problems += model_problems or (attention_problems(c) + position_problems(c) + moe_problems(c)
                                       + mistyped_target_problems(c) + layer_problems(c) + oft_size_problems(c)
                                       + depth_checkpoint_problems(c) + badam_layer_problems(c))
    if c.output_dir is not None:
        problems += output_dir_problems(c)
    problems += write_problems(c)
    problems += [p for p in (adapter_folder_problem("adapter_name_or_path", a) for a in c.adapter_name_or_path) if p]
    problems += other_folder_problems(c)
    resume = resume_source(c)
    if resume is not None:
        key = "resume_from_checkpoint" if c.resume_from_checkpoint else f"output_dir (resuming from {resume})"
        problems += checkpoint_problems(resume, key)
    return problems


# Folder keys checked nowhere else, with what each folder receives (a file there would fail the run late).
OTHER_FOLDER_KEYS = (("logging_dir", "tensorboard writes its event files there"),
                     ("ray_storage_path", "Ray Train keeps its run state there"))


def other_folder_problems(c: TrainConfig) -> list[str]:
    """A file given for a folder a run writes into (a missing one is created)."""
    problems = []
    for key, what in OTHER_FOLDER_KEYS:
        value = getattr(c, key)
        if value and Path(value).exists() and not Path(value).is_dir():
            problems.append(f"{key}: {value} is a file; give a folder ({what})")
    return problems


def adapter_folder_problem(key: str, folder: str) -> str | None:
    """Why ``folder`` is not a peft adapter folder (missing, a file, or without adapter_config.json)."""
    problem = folder_problem(key, folder, "the adapter folder (the one holding adapter_config.json)")
    if problem is None and not (Path(folder) / "adapter_config.json").is_file():
        return f"{key}: {folder} is not a peft adapter folder (no adapter_config.json)"
    return problem


def model_path_problems(model: str) -> list[str]:
    path = Path(model)
    if path.is_dir():
        return model_folder_problems(path)
    if path.exists():
        return [f"model_name_or_path: {model} is a file; give the model folder"]
    if reads_as_hub_id(model):
        return []  # a hub id: resolved by transformers at load time
    return [f"model_name_or_path: folder not found: {shown(model, quote=False)} (set build_tiny_model_if_missing: "
            "true to create a tiny demo model there)"]


def output_dir_problems(c: TrainConfig) -> list[str]:
    out = Path(c.output_dir or "")
    if out.exists() and not out.is_dir():
        return [f"output_dir: {out} is a file; give a folder (a new one, or an earlier run's)"]
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        return [f"output_dir: cannot create {out}: {existing} is a file"]
    if not os.access(existing, os.W_OK):
        return [f"output_dir: {existing} is not writable; choose another output_dir"]
    finished = out / run_files.RESULTS
    if finished.is_file() and not c.overwrite_output_dir and not c.resume_from_checkpoint:
        last = latest_checkpoint(out)
        go_on = f", set resume_from_checkpoint: {shown(str(last), quote=False)} to train on from its last checkpoint" \
            if last is not None else ""
        return [f"output_dir: {out} already holds a finished run (train_results.json); "
                f"set overwrite_output_dir: true to replace it{go_on}, or choose another output_dir"]
    return []
