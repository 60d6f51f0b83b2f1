"""Records written in another format than their dataset_info.json entry says: which entry keys would read them.

LLaMA-Factory's formats differ by a few names (alpaca's instruction/output columns, sharegpt's conversations with
from/value turns and human/gpt roles, OpenAI's messages with role/content and user/assistant), so a file is often
registered under the wrong one. "no 'conversations' column" or "turn 1 must be an object with 'from' and 'value'"
is true but leaves the user to work out the fix; these hints name the keys to set. Import-light (the registry only):
the launching host's checks and the training-time converters both use them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from shardtune.data.registry import DEFAULT_COLUMNS, DEFAULT_TAGS, DatasetEntry

# Formats told apart by their records' columns, and the columns that say so (alpaca needs both of its own).
SIGNATURE_COLUMNS = {"openai": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output")}
# Formats whose turns carry role tags, each with its default tags.
TAGGED = ("sharegpt", "openai")


def formatting_hint(found: list[str], entry: DatasetEntry) -> str:
    """'set "formatting": X' when the record's columns are another format's defaults ("" when none is)."""
    for formatting, columns in SIGNATURE_COLUMNS.items():
        if formatting != entry.formatting and set(columns) <= set(found):
            return (f"these look like {formatting} records: set \"formatting\": \"{formatting}\" in its "
                    "dataset_info.json entry")
    return ""


def turn_tags_hint(turn: Any, tags: Mapping[str, str]) -> str:
    """The ``tags`` that would read ``turn`` when its keys or its role are another format's ("" when unknown)."""
    if not isinstance(turn, dict):
        return ""
    for formatting in TAGGED:
        other = DEFAULT_TAGS[formatting]
        if tags["role_tag"] not in turn and {other["role_tag"], other["content_tag"]} <= set(turn):
            wanted = {key: other[key] for key in ("role_tag", "content_tag", "user_tag", "assistant_tag")}
            return (f"its turns have '{other['role_tag']}'/'{other['content_tag']}' (as {formatting} records), not "
                    f"'{tags['role_tag']}'/'{tags['content_tag']}': set \"tags\": {json.dumps(wanted)} in its "
                    "dataset_info.json entry")
        role = turn.get(tags["role_tag"])
        if role in (other["user_tag"], other["assistant_tag"]) and role not in tags.values():
            wanted = {key: other[key] for key in ("user_tag", "assistant_tag")}
            return (f"its turns have the role '{role}' (as {formatting} records), not '{tags['user_tag']}'/"
                    f"'{tags['assistant_tag']}': set \"tags\": {json.dumps(wanted)} in its dataset_info.json entry")
    return ""


def first_turn_problems(record: Any, entry: DatasetEntry) -> list[str]:
    """What the first turn of a sharegpt/openai ``record`` says about the entry's tags, for the launching host."""
    if entry.formatting not in TAGGED or not isinstance(record, dict):
        return []
    turns = record.get(entry.columns.get("messages", DEFAULT_COLUMNS[entry.formatting]["messages"]))
    hint = turn_tags_hint(turns[0], entry.tags) if isinstance(turns, list) and turns else ""
    return [f"{entry.path}: dataset '{entry.name}', record 1: {hint}"] if hint else []
