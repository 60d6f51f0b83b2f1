"""Which columns a dataset's records must have for a stage, and whether an entry fits the stage.

Import-light (no ``datasets``): the launching host checks these before any process starts.
"""

from __future__ import annotations

from shardtune.data.lf_v1_data import V1_FORMATTING
from shardtune.data.other_format import formatting_hint
from shardtune.data.registry import DatasetEntry

PREFERENCE_STAGES = ("dpo", "kto", "rm")
PAIR_STAGES = ("dpo", "rm")


def is_preference_stage(stage: str) -> bool:
    return stage in PREFERENCE_STAGES


def preference_entry_problems(entry: DatasetEntry, stage: str) -> list[str]:
    """Does the entry carry what the stage reads (pairs for dpo/rm, a kto_tag for kto)?"""
    if stage in PAIR_STAGES and not entry.ranking:
        return [f"dataset '{entry.name}' is not a ranking dataset, which stage {stage} needs (a prompt with a "
                "chosen and a rejected answer); set \"ranking\": true and columns.chosen/rejected in its "
                "dataset_info.json entry, or use another dataset"]
    if stage == "kto" and "kto_tag" not in entry.columns:
        return [f"dataset '{entry.name}' has no kto_tag column, which stage kto needs (true: desirable answer); "
                "set columns.kto_tag in its dataset_info.json entry"]
    if stage == "kto" and entry.ranking:
        return [f"dataset '{entry.name}' is a ranking dataset; stage kto reads one answer per record with a "
                "kto_tag, use stage dpo for pairs"]
    return []


def preference_columns(entry: DatasetEntry, stage: str) -> dict[str, str]:
    """Registry column key -> column name every record of ``entry`` must have for ``stage``."""
    if stage == "kto":
        keys: tuple[str, ...] = ("kto_tag",) + (("prompt", "response") if entry.formatting == "alpaca"
                                                else ("messages",))
    elif entry.formatting == V1_FORMATTING:  # v1's pairs: two whole conversations, no shared column
        keys = ("chosen", "rejected")
    else:
        keys = ("prompt" if entry.formatting == "alpaca" else "messages", "chosen", "rejected")
    return {key: entry.columns[key] for key in keys}


def required_columns(entry: DatasetEntry, stage: str) -> dict[str, str]:
    """Registry column key -> column name that every record of ``entry`` must have for ``stage``."""
    if stage == "pt":
        return {"prompt": entry.columns["prompt"]}
    if entry.formatting != "alpaca":
        return {"messages": entry.columns["messages"]}
    return {key: entry.columns[key] for key in ("prompt", "response")}


def missing_column_problems(found: list[str], entry: DatasetEntry, stage: str) -> list[str]:
    """One line per required column that ``found`` lacks, saying how to map it; one line naming the formatting to
    set when the records are another format's (its columns would all be missing)."""
    missing = {key: column for key, column in required_columns(entry, stage).items() if column not in found}
    hint = formatting_hint(found, entry) if missing and stage != "pt" else ""
    if hint:
        names = "/".join(f"'{column}'" for column in missing.values()) + (" columns" if len(missing) > 1 else " column")
        return [f"{entry.path}: records have no {names} (dataset '{entry.name}', stage {stage}, found: "
                f"{', '.join(found)}); {hint}"]
    return [
        f"{entry.path}: records have no '{column}' column (dataset '{entry.name}', stage {stage}, "
        f"found: {', '.join(found) or 'none'}); rename it or set columns.{key} in dataset_info.json"
        for key, column in missing.items()
    ]
