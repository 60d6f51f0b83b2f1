"""The dataset registry: ``dataset_info.json`` entries resolved into typed ``DatasetEntry`` objects.

The file follows LLaMA-Factory's layout so that users can bring theirs::

    {"demo": {"file_name": "demo_alpaca.json", "formatting": "alpaca",
              "columns": {"prompt": "instruction", ...}, "tags": {"role_tag": "from", ...}}}

Only local files are supported; hub downloads belong to the user's own preparation step.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INFO_FILE = "dataset_info.json"
LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
FORMATTINGS = ("alpaca", "sharegpt")
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
               "history": "history"},
    "sharegpt": {"messages": "conversations", "system": "system"},
}
DEFAULT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                "system_tag": "system"}
# Tags LLaMA-Factory knows for tool calls; accepted so its files load, unused because we train no tool turns.
EXTRA_TAGS = ("observation_tag", "function_tag")
ENTRY_KEYS = ("file_name", "formatting", "columns", "tags")
# LLaMA-Factory keys that point at remote data or features we do not implement.
UNSUPPORTED_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name", "subset", "split",
                    "folder", "num_samples", "ranking")


@dataclass(frozen=True)
class DatasetEntry:
    """One resolved registry entry; ``columns`` and ``tags`` already include the defaults."""

    name: str
    path: Path
    formatting: str
    columns: Mapping[str, str]
    tags: Mapping[str, str]

    @property
    def loader(self) -> str:
        """The ``datasets`` builder that reads this file: json, csv or parquet."""
        return LOADERS[self.path.suffix.lower()]


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or an empty string when nothing is close."""
    matches = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def info_path(dataset_dir: str | Path) -> Path:
    return Path(dataset_dir) / INFO_FILE


def load_registry(dataset_dir: str | Path) -> tuple[dict[str, Any], list[str]]:
    """Read ``dataset_info.json``; returns (entries, problems) and never raises for user mistakes."""
    directory = Path(dataset_dir)
    path = info_path(directory)
    if not directory.is_dir():
        return {}, [f"dataset_dir '{directory}' does not exist; set dataset_dir to the folder holding {INFO_FILE}"]
    if not path.is_file():
        return {}, [f"{path} does not exist; create it (see data/{INFO_FILE} in the shardtune repo for the layout)"]
    try:
        registry = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        return {}, [f"{path} line {err.lineno}: not valid JSON ({err.msg}, column {err.colno})"]
    except (OSError, UnicodeDecodeError) as err:
        return {}, [f"{path}: cannot be read ({err})"]
    if not isinstance(registry, dict):
        return {}, [f"{path}: expected an object mapping dataset names to entries, got {type(registry).__name__}"]
    return registry, []


def resolve_entries(names: list[str], dataset_dir: str | Path) -> tuple[list[DatasetEntry], list[str]]:
    """Look up every name and validate its entry; all problems are collected, not just the first."""
    registry, problems = load_registry(dataset_dir)
    if problems:
        return [], problems
    path = info_path(dataset_dir)
    entries: list[DatasetEntry] = []
    for name in names:
        if name not in registry:
            hint = did_you_mean(name, registry) or f"; known: {', '.join(sorted(registry)[:12]) or 'none'}"
            problems.append(f"unknown dataset '{name}' in {path}{hint}")
            continue
        entry, entry_problems = resolve_entry(name, registry[name], Path(dataset_dir), path)
        problems += entry_problems
        if entry is not None:
            entries.append(entry)
    return entries, problems


def resolve_entry(name: str, raw: Any, dataset_dir: Path, path: Path) -> tuple[DatasetEntry | None, list[str]]:
    """Validate one entry of the registry and fill in default columns and tags."""
    where = f"{path}: dataset '{name}'"
    if not isinstance(raw, dict):
        return None, [f"{where} must be an object with a file_name, got {type(raw).__name__}"]
    problems = key_problems(raw, where)
    formatting = raw.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        problems.append(f"{where} has formatting '{formatting}'; use one of {', '.join(FORMATTINGS)}"
                        f"{did_you_mean(str(formatting), FORMATTINGS)}")
        formatting = "alpaca"
    columns = mapping_field(raw, "columns", DEFAULT_COLUMNS[formatting], (), where, problems)
    tags = mapping_field(raw, "tags", DEFAULT_TAGS, EXTRA_TAGS, where, problems)
    file_path = data_file_problems(raw, dataset_dir, where, problems)
    if problems or file_path is None:
        return None, problems
    return DatasetEntry(name, file_path, formatting, columns, tags), []


def key_problems(raw: dict[str, Any], where: str) -> list[str]:
    problems = []
    for key in raw:
        if key in UNSUPPORTED_KEYS:
            if key == "ranking" and not raw[key]:
                continue
            problems.append(f"{where} uses '{key}', which shardtune does not support; "
                            "download the data and point file_name at a local file")
        elif key not in ENTRY_KEYS:
            problems.append(f"{where} has unknown key '{key}'{did_you_mean(key, ENTRY_KEYS)}")
    return problems


def mapping_field(raw: dict[str, Any], key: str, defaults: dict[str, str], extra: tuple[str, ...], where: str,
                  problems: list[str]) -> dict[str, str]:
    """Merge ``raw[key]`` (a str->str object such as ``columns``) over the defaults, reporting bad keys."""
    given = raw.get(key, {})
    if not isinstance(given, dict):
        problems.append(f"{where}: '{key}' must be an object, got {type(given).__name__}")
        return dict(defaults)
    allowed = (*defaults, *extra)
    for sub_key, value in given.items():
        if sub_key not in allowed:
            problems.append(f"{where}: unknown {key} key '{sub_key}'{did_you_mean(sub_key, allowed)}; "
                            f"allowed: {', '.join(allowed)}")
        elif not isinstance(value, str):
            problems.append(f"{where}: {key}.{sub_key} must be a string, got {value!r}")
    return {**defaults, **{k: v for k, v in given.items() if isinstance(v, str)}}


def data_file_problems(raw: dict[str, Any], dataset_dir: Path, where: str, problems: list[str]) -> Path | None:
    """The entry's data file if it exists and has a readable extension; otherwise append why not."""
    file_name = raw.get("file_name")
    if not isinstance(file_name, str) or not file_name:
        if not any(key in raw for key in UNSUPPORTED_KEYS):
            problems.append(f"{where} needs a 'file_name' (a file inside {dataset_dir})")
        return None
    file_path = dataset_dir / file_name
    if file_path.suffix.lower() not in LOADERS:
        problems.append(f"{where}: file '{file_name}' has an unsupported extension; "
                        f"use one of {', '.join(LOADERS)}")
        return None
    if not file_path.is_file():
        problems.append(f"{where}: file {file_path} does not exist")
        return None
    return file_path
