"""Cheap checks of the data settings, run by ``shardtune check`` and before any process is spawned.

No tokenizer and no full read of the data: registry, file existence and extension, the first record's
columns, and the template name. Everything found is returned together.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from shardtune.data.columns import (
    is_preference_stage,
    missing_column_problems,
    preference_columns,
    preference_entry_problems,
)
from shardtune.data.images import image_support_problem
from shardtune.data.lf_v1_data import V1_FORMATTING, first_record_problems
from shardtune.data.other_format import first_turn_problems, formatting_hint
from shardtune.data.peek import first_record, peek_columns
from shardtune.data.registry import DatasetEntry, did_you_mean, resolve_entries
from shardtune.data.settings import MIX_STRATEGIES, STAGES, DataSettings, dataset_names
from shardtune.data.templates import (
    TEMPLATES,
    TOOL_FORMATS,
    unknown_template_message,
    unknown_tool_format_message,
)


def check_data_settings(settings: DataSettings) -> list[str]:
    """Problems with ``settings`` and the datasets they name, one line each (empty = ok)."""
    problems = setting_problems(settings)
    names = dataset_names(settings)
    if not names:
        return problems + ["dataset is empty; name at least one entry of dataset_info.json, e.g. dataset: demo"]
    problems += [f"dataset: '{name}' is listed twice; each dataset is read once (to weight one, use mix_strategy "
                 "interleave_* with interleave_probs)" for name in sorted({n for n in names if names.count(n) > 1})]
    entries, entry_problems = resolve_entries(names, settings.dataset_dir)
    problems += entry_problems
    if settings.eval_dataset:
        eval_entries, eval_problems = resolve_entries([n for n in settings.eval_dataset if n not in names],
                                                      settings.dataset_dir, key="eval_dataset")
        entries += eval_entries
        problems += [p for p in eval_problems if p not in problems]
    for entry in entries:
        problems += entry_stage_problems(entry, settings.stage)
        if "images" in entry.columns:
            problems += image_problems(entry, settings)
        if settings.streaming and entry.num_samples is not None:
            problems.append(f"dataset '{entry.name}' sets num_samples ({entry.num_samples}) in dataset_info.json, "
                            "which streaming (true) cannot draw (it needs the dataset's length up front); remove "
                            "num_samples from the entry or set streaming: false")
    return problems


IMAGE_STAGES = ("sft", "dpo")  # dpo: pairs whose shared prompt holds the images (orpo/simpo are dpo's losses)


def image_problems(entry: DatasetEntry, settings: DataSettings) -> list[str]:
    """What stops the images of ``entry`` from being trained with ``settings`` (data/images.py)."""
    where = f"dataset '{entry.name}' has images (columns.images)"
    if settings.stage not in IMAGE_STAGES:
        return [f"{where}: images in {settings.stage} data are not read yet; images train with stage "
                f"{' or '.join(IMAGE_STAGES)}"]
    if settings.packing:
        return [f"{where}: packing (true) with images: a packed row would need each sample's multimodal positions "
                "(mRoPE) restarted, which shardtune does not build; set packing: false"]
    if settings.streaming:
        return [f"{where}: streaming (true) reads text only; set streaming: false to train on the images"]
    model_type = model_type_of(settings.model_dir)
    problem = image_support_problem(model_type) if model_type else None
    return [f"{where}, but {problem}"] if problem else []


def model_type_of(model_dir: str) -> str | None:
    """``model_type`` of the folder's config.json (None when there is none to read: other checks name that)."""
    try:
        found = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def setting_problems(settings: DataSettings) -> list[str]:
    problems = []
    if settings.stage not in STAGES:
        problems.append(f"stage '{settings.stage}' is not supported by the data pipeline; "
                        f"use one of {', '.join(STAGES)}{did_you_mean(settings.stage, STAGES)}")
    if settings.template not in TEMPLATES:
        problems.append(unknown_template_message(settings.template))
    if settings.tool_format is not None and settings.tool_format not in TOOL_FORMATS:
        problems.append(unknown_tool_format_message(settings.tool_format))
    if settings.cutoff_len < 1:
        problems.append(f"cutoff_len ({settings.cutoff_len}) must be a positive number of tokens")
    if settings.stage == "pt" and settings.excess_length_strategy == "drop":  # pt has no samples to drop
        problems.append("excess_length_strategy (drop) with stage (pt): pre-training cuts its text into rows of "
                        "cutoff_len and drops nothing; the key is for sft and preference samples: remove it")
    if settings.max_samples is not None and settings.max_samples < 1:
        problems.append(f"max_samples ({settings.max_samples}) must be at least 1, or unset to use all samples")
    val_size = settings.val_size
    if val_size < 0 or (val_size >= 1 and val_size != int(val_size)):
        problems.append(f"val_size ({val_size}) must be a fraction in [0, 1) or a whole number of samples")
    workers = settings.preprocessing_num_workers
    if workers is not None and workers < 1:
        problems.append(f"preprocessing_num_workers ({workers}) must be at least 1, or unset for no workers")
    if settings.preprocessing_batch_size < 1:
        problems.append(f"preprocessing_batch_size ({settings.preprocessing_batch_size}) must be at least 1")
    if settings.eval_dataset and settings.val_size > 0:
        problems.append(f"eval_dataset ({','.join(settings.eval_dataset)}) and val_size ({settings.val_size}) are "
                        "both set; evaluate on the named datasets or on a hold-out, not both (unset one)")
    if settings.mask_history and settings.train_on_prompt:
        problems.append("mask_history (true) and train_on_prompt (true) contradict each other: one trains only the "
                        "last answer, the other every prompt too; unset one")
    if settings.neat_packing and settings.stage == "pt":
        problems.append("neat_packing (true) with stage pt: pt packing cuts one stream of texts into blocks, so "
                        "texts are not kept apart; unset neat_packing (or use stage sft)")
    if is_preference_stage(settings.stage) and (settings.packing or settings.neat_packing or settings.streaming):
        problems.append(f"stage {settings.stage}: packing, neat_packing and streaming are not supported for "
                        "preference data yet (a pair is padded into one batch); set them to false")
    return problems + mix_problems(settings) + streaming_problems(settings)


def streaming_problems(settings: DataSettings) -> list[str]:
    """What a stream cannot do: it has no length until it has been read to the end."""
    if not settings.streaming:
        return []
    problems = []
    if 0 < settings.val_size < 1:
        problems.append(f"val_size ({settings.val_size}) is a fraction, but with streaming (true) the number of "
                        "samples is unknown; give a whole number of samples to hold out (e.g. val_size: 100), or "
                        "eval_dataset")
    if settings.buffer_size < 1:
        problems.append(f"buffer_size ({settings.buffer_size}) must be at least 1 (1 keeps the files' order)")
    return problems


def mix_problems(settings: DataSettings) -> list[str]:
    """mix_strategy and interleave_probs: one probability per dataset, summing to 1."""
    strategy, probs = settings.mix_strategy, settings.interleave_probs
    if strategy not in MIX_STRATEGIES:
        return [f"mix_strategy '{strategy}' is unknown; use one of {', '.join(MIX_STRATEGIES)}"
                f"{did_you_mean(strategy, MIX_STRATEGIES)}"]
    if not probs:
        return []
    if strategy == "concat":
        return [f"interleave_probs ({','.join(map(str, probs))}) only applies to an interleave mix_strategy, "
                "not concat; set mix_strategy: interleave_under (or interleave_over), or unset interleave_probs"]
    names = dataset_names(settings)
    if len(probs) != len(names):
        return [f"interleave_probs has {len(probs)} values but dataset names {len(names)} datasets "
                f"({','.join(names)}); give one probability per dataset"]
    if not all(math.isfinite(p) and p >= 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
        return [f"interleave_probs ({','.join(map(str, probs))}) must be numbers >= 0 that sum to 1"]
    return []


def entry_stage_problems(entry: DatasetEntry, stage: str) -> list[str]:
    """Does the entry fit the stage, and does its first record have the columns the stage reads?"""
    if is_preference_stage(stage):
        return preference_stage_problems(entry, stage)
    preference = preference_problems(entry, stage)
    if preference:
        return preference
    if stage == "pt" and entry.formatting != "alpaca":
        return [f"dataset '{entry.name}' is {entry.formatting} but stage pt reads plain text; use an alpaca "
                "entry whose columns.prompt names the text column"]
    if stage not in STAGES:
        return []
    if entry.formatting == V1_FORMATTING:
        return first_record_problems(entry.data_files[0], entry.name)
    columns, problems = peek_columns(entry.data_files[0])
    if columns is not None:
        problems += missing_column_problems(columns, entry, stage)
    if not problems:  # the columns fit: do the first record's turns use the entry's tags?
        problems += first_turn_problems(first_record(entry.data_files[0]), entry)
    return problems


def preference_stage_problems(entry: DatasetEntry, stage: str) -> list[str]:
    """dpo/rm need a ranking entry, kto an entry with kto_tag; the first record must have their columns."""
    problems = preference_entry_problems(entry, stage)
    if problems:
        return problems
    columns, problems = peek_columns(entry.data_files[0])
    if columns is not None:
        problems += preference_column_problems(columns, entry, stage)
    if entry.formatting == V1_FORMATTING and not problems:
        problems += first_record_problems(entry.data_files[0], entry.name)
    elif not problems:  # the columns fit: do the first record's turns use the entry's tags?
        problems += first_turn_problems(first_record(entry.data_files[0]), entry)
    return problems


def preference_column_problems(found: list[str], entry: DatasetEntry, stage: str) -> list[str]:
    """One line per column the stage reads that the first record lacks; one line naming the formatting to set when
    the records are another format's."""
    missing = {key: column for key, column in preference_columns(entry, stage).items() if column not in found}
    hint = formatting_hint(found, entry) if missing else ""
    if hint:
        names = "/".join(f"'{column}'" for column in missing.values())
        return [f"{entry.path}: records have no {names} column (dataset '{entry.name}', stage {stage}); {hint}"]
    return [f"{entry.path}: records have no '{column}' column (dataset '{entry.name}', stage {stage}); rename it or "
            f"set columns.{key} in dataset_info.json" for key, column in missing.items()]


def preference_problems(entry: DatasetEntry, stage: str) -> list[str]:
    """Ranking (chosen/rejected) and KTO (kto_tag) entries: their columns are checked, and the stages that
    train on one answer per prompt refuse them rather than silently dropping the preference."""
    wanted = [entry.columns[key] for key in ("chosen", "rejected", "kto_tag") if key in entry.columns]
    if not entry.ranking and "kto_tag" not in entry.columns:
        return []
    columns, problems = peek_columns(entry.data_files[0])
    if columns is not None:
        problems += [f"{entry.path}: records have no '{name}' column (dataset '{entry.name}'), which its columns "
                     "name; rename it or fix columns in dataset_info.json" for name in wanted if name not in columns]
    kind = "a ranking (chosen/rejected)" if entry.ranking else "a KTO (kto_tag)"
    return problems + [f"dataset '{entry.name}' is {kind} dataset, which stage {stage} cannot train on (it "
                       "learns one answer per prompt); use it with a preference stage, or remove it from dataset"]
