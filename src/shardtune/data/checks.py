"""Cheap checks of the data settings, run by ``shardtune check`` and before any process is spawned.

No tokenizer and no full read of the data: registry, file existence and extension, the first record's
columns, and the template name. Everything found is returned together.
"""

from __future__ import annotations

from shardtune.data.formats import missing_column_problems
from shardtune.data.loading import peek_columns
from shardtune.data.registry import DatasetEntry, did_you_mean, resolve_entries
from shardtune.data.settings import STAGES, DataSettings, dataset_names
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
    entries, entry_problems = resolve_entries(names, settings.dataset_dir)
    problems += entry_problems
    for entry in entries:
        problems += entry_stage_problems(entry, settings.stage)
    return problems


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
    if settings.max_samples is not None and settings.max_samples < 1:
        problems.append(f"max_samples ({settings.max_samples}) must be at least 1, or unset to use all samples")
    val_size = settings.val_size
    if val_size < 0 or (val_size >= 1 and val_size != int(val_size)):
        problems.append(f"val_size ({val_size}) must be a fraction in [0, 1) or a whole number of samples")
    workers = settings.preprocessing_num_workers
    if workers is not None and workers < 1:
        problems.append(f"preprocessing_num_workers ({workers}) must be at least 1, or unset for no workers")
    return problems


def entry_stage_problems(entry: DatasetEntry, stage: str) -> list[str]:
    """Does the entry fit the stage, and does its first record have the columns the stage reads?"""
    if stage == "pt" and entry.formatting != "alpaca":
        return [f"dataset '{entry.name}' is {entry.formatting} but stage pt reads plain text; use an alpaca "
                "entry whose columns.prompt names the text column"]
    if stage not in STAGES:
        return []
    columns, problems = peek_columns(entry.path)
    if columns is not None:
        problems += missing_column_problems(columns, entry, stage)
    return problems
