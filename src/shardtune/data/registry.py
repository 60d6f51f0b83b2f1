"""The dataset registry: ``dataset_info.json`` entries resolved into typed ``DatasetEntry`` objects.

The file follows LLaMA-Factory's layout so that users can bring theirs::

    {"demo": {"file_name": "demo_alpaca.json", "formatting": "alpaca",
              "columns": {"prompt": "instruction", ...}, "tags": {"role_tag": "from", ...}}}

``file_name`` may name a file or a folder of files (``folder``, ``subset`` and ``split`` pick inside it, see
``datafiles``). Entries on a hub (``hf_hub_url``, ``ms_hub_url``, ``om_hub_url``) are brought into the hub's
cache when ``dataset`` names them and then read the same way (``hub_data``); ``dataset_dir: REMOTE:org/name`` is a
registry on the hub.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune.data.datafiles import pick_data_files
from shardtune.data.hub_data import HUB_URL_KEYS, UNREAD_SOURCE_KEYS, dataset_folder, fetch_hub_entry, is_hub_entry
from shardtune.data.lf_v1_data import V1_FORMATTING, is_v1_dataset_file, load_v1_registry, v1_media_dir
from shardtune.paths import ascii_lookalike, shown, url_problem

INFO_FILE = "dataset_info.json"
LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
FORMATTINGS = ("alpaca", "sharegpt", "openai", V1_FORMATTING)
# Columns every formatting may map; preference (chosen, rejected) and KTO (kto_tag) columns are validated
# now and read by preference stages, which refuse them for sft (see checks.entry_stage_problems).
COMMON_COLUMNS = ("system", "tools", "chosen", "rejected", "kto_tag", "images")
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
               "history": "history", "tools": "tools"},
    "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools"},
    "openai": {"messages": "messages", "system": "system", "tools": "tools"},
}
DEFAULT_TAGS: dict[str, dict[str, str]] = {
    "sharegpt": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"},
    "openai": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
               "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system"},
}
DEFAULT_TAGS["alpaca"] = DEFAULT_TAGS["sharegpt"]
# LLaMA-Factory v1's own records: OpenAI-style turns whose content is a list of typed parts (data/lf_v1_data.py).
DEFAULT_COLUMNS[V1_FORMATTING] = DEFAULT_COLUMNS["openai"]
DEFAULT_TAGS[V1_FORMATTING] = DEFAULT_TAGS["openai"]
# LLaMA-Factory's video and audio columns: refused by name (images are read: data/images.py).
MEDIA_COLUMNS = ("videos", "audios")
ENTRY_KEYS = ("file_name", "formatting", "columns", "tags", "ranking", "subset", "split", "folder", "num_samples",
              *HUB_URL_KEYS, "revision", *UNREAD_SOURCE_KEYS)


@dataclass(frozen=True)
class DatasetEntry:
    """One resolved registry entry; ``columns`` and ``tags`` already include the defaults.

    ``path`` is what ``file_name`` names (a file or a folder); ``files`` the data files picked from it by
    ``folder``, ``subset`` and ``split``. ``num_samples`` draws that many records (see loading.sample_records).
    """

    name: str
    path: Path
    formatting: str
    columns: Mapping[str, str]
    tags: Mapping[str, str]
    files: tuple[Path, ...] = ()
    ranking: bool = False
    num_samples: int | None = None
    split: str = "train"
    media_dir: Path = Path()  # where relative image paths start: dataset_dir (LLaMA-Factory), a v1 file: the cwd

    @property
    def loader(self) -> str:
        """The ``datasets`` builder that reads this entry's files: json, csv or parquet."""
        return LOADERS[(self.files[0] if self.files else self.path).suffix.lower()]

    @property
    def data_files(self) -> tuple[Path, ...]:
        return self.files or (self.path,)


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or an empty string when nothing is close."""
    matches = difflib.get_close_matches(ascii_lookalike(word), list(options), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def info_path(dataset_dir: str | Path) -> Path:
    """The registry file: ``dataset_info.json`` in the folder, or the folder itself when it is a LLaMA-Factory v1
    dataset file (YAML)."""
    return Path(dataset_dir) if is_v1_dataset_file(dataset_dir) else Path(dataset_dir) / INFO_FILE


def load_registry(dataset_dir: str | Path) -> tuple[dict[str, Any], list[str]]:
    """Read ``dataset_info.json``; returns (entries, problems) and never raises for user mistakes."""
    if is_v1_dataset_file(dataset_dir):
        return load_v1_registry(Path(dataset_dir))
    directory, problems = dataset_folder(dataset_dir)
    if problems:
        return {}, problems
    path = info_path(directory)
    if directory.exists() and not directory.is_dir():
        own_folder = f" ({directory.parent})" if directory.name == INFO_FILE else ""
        return {}, [f"dataset_dir: {shown(str(directory), quote=False)} is a file; give the folder holding "
                    f"{INFO_FILE}{own_folder}"]
    if not directory.is_dir():
        return {}, [f"dataset_dir {shown(str(directory))} does not exist; set dataset_dir to the folder holding "
                    f"{INFO_FILE}"]
    if path.is_dir():
        return {}, [f"{path} is a folder; it must be the JSON file that registers the datasets"]
    if not path.is_file():
        return {}, [f"{path} does not exist; create it (see data/{INFO_FILE} in the shardtune repo for the layout)"]
    try:
        text = path.read_text(encoding="utf-8")
        repeated: list[str] = []
        registry = json.loads(text, object_pairs_hook=lambda pairs: _without_repeats(pairs, repeated))
    except json.JSONDecodeError as err:
        return {}, [f"{path} line {err.lineno}: not valid JSON ({err.msg}, column {err.colno})"]
    except UnicodeDecodeError as err:
        return {}, [f"{path}: not valid UTF-8 (byte 0x{err.object[err.start]:02x} at offset {err.start}); save it "
                    "as UTF-8"]
    except OSError as err:
        return {}, [f"{path}: cannot be read ({err.strerror or err})"]
    if not isinstance(registry, dict):
        return {}, [f"{path}: expected an object mapping dataset names to entries, got {type(registry).__name__}"]
    if repeated:
        return {}, [f"{path}{_lines_of(text, name)}: '{name}' is given twice in one object; JSON would silently "
                    "keep the last one: keep one (or rename one)" for name in dict.fromkeys(repeated)]
    return registry, []


def _without_repeats(pairs: list[tuple[str, Any]], repeated: list[str]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, noting every key given twice (json keeps the last one silently)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            repeated.append(key)
        seen[key] = value
    return seen


def _lines_of(text: str, key: str) -> str:
    """`` lines 3 and 9``: where ``"key":`` stands in ``text``."""
    lines = [text.count("\n", 0, m.start()) + 1 for m in re.finditer(rf'"{re.escape(key)}"\s*:', text)]
    return f" lines {' and '.join(map(str, lines))}" if len(lines) > 1 else ""


def separator_hint(name: str, registry: dict[str, Any]) -> str:
    """`` (names are separated by commas: a,b)`` when ``name`` is known names joined by spaces or semicolons."""
    parts = [p for p in re.split(r"[\s;]+", name) if p]
    if len(parts) > 1 and all(p in registry for p in parts):
        return f"; names are separated by commas: {','.join(parts)}"
    return ""


def resolve_entries(names: list[str], dataset_dir: str | Path, key: str = "dataset"
                    ) -> tuple[list[DatasetEntry], list[str]]:
    """Look up every name and validate its entry; all problems are collected, not just the first. ``key``: the
    config key that lists the names, for the messages."""
    registry, problems = load_registry(dataset_dir)
    if problems:
        return [], problems
    dataset_dir, _ = dataset_folder(dataset_dir)  # REMOTE:org/name: the snapshot load_registry just read
    path = info_path(dataset_dir)
    entries: list[DatasetEntry] = []
    for name in dict.fromkeys(names):
        if name not in registry:
            hint = (separator_hint(name, registry) or did_you_mean(name, registry)
                    or f"; known: {', '.join(sorted(registry)[:12]) or 'none'}")
            problems.append(f"{key}: unknown dataset {shown(name)} in {path}{hint}")
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
    columns = mapping_field(raw, "columns", DEFAULT_COLUMNS[formatting], COMMON_COLUMNS, where, problems)
    tags = mapping_field(raw, "tags", DEFAULT_TAGS[formatting], (), where, problems)
    ranking, num_samples, split = option_values(raw, columns, where, problems)
    if is_hub_entry(raw):
        if problems:  # nothing is downloaded for an entry that could not be read anyway
            return None, problems
        file_path, problems = fetch_hub_entry(raw, where)
    else:
        file_path = data_path_problems(raw, dataset_dir, where, problems)
    if problems or file_path is None:
        return None, problems
    files, file_problems = pick_data_files(file_path, raw.get("folder"), raw.get("subset"), split, where)
    if file_problems:
        return None, file_problems
    media_dir = v1_media_dir() if is_v1_dataset_file(dataset_dir) else dataset_dir  # hub entries too, as there
    return DatasetEntry(name, file_path, formatting, columns, tags, files, ranking, num_samples, split, media_dir), []


def key_problems(raw: dict[str, Any], where: str) -> list[str]:
    return [f"{where} has unknown key '{key}'{did_you_mean(key, ENTRY_KEYS)}" for key in raw if key not in ENTRY_KEYS]


def option_values(raw: dict[str, Any], columns: Mapping[str, str], where: str, problems: list[str]
                  ) -> tuple[bool, int | None, str]:
    """ranking, num_samples and split, checked; problems are appended."""
    ranking = raw.get("ranking", False)
    if not isinstance(ranking, bool):
        problems.append(f"{where}: ranking must be true or false, got {ranking!r}")
        ranking = False
    if ranking and not {"chosen", "rejected"} <= set(columns):
        problems.append(f"{where} is a ranking dataset but columns lack chosen/rejected; "
                        "name the preferred and the rejected answer columns")
    num_samples = raw.get("num_samples")
    if num_samples is not None and (not isinstance(num_samples, int) or isinstance(num_samples, bool)
                                    or num_samples < 1):
        problems.append(f"{where}: num_samples must be a positive whole number, got {num_samples!r}")
        num_samples = None
    for key in ("split", "subset", "folder", "revision"):
        if raw.get(key) is not None and (not isinstance(raw[key], str) or not raw[key]):
            problems.append(f"{where}: {key} must be a non-empty string, got {raw[key]!r}")
    split = raw.get("split") or "train"
    return ranking, num_samples, split if isinstance(split, str) else "train"


def mapping_field(raw: dict[str, Any], key: str, defaults: dict[str, str], extra: tuple[str, ...], where: str,
                  problems: list[str]) -> dict[str, str]:
    """Merge ``raw[key]`` (a str->str object such as ``columns``) over the defaults, reporting bad keys."""
    given = raw.get(key, {})
    if not isinstance(given, dict):
        problems.append(f"{where}: '{key}' must be an object, got {type(given).__name__}")
        return dict(defaults)
    allowed = tuple(dict.fromkeys((*defaults, *extra)))
    for sub_key, value in given.items():
        if sub_key in MEDIA_COLUMNS:
            problems.append(f"{where}: columns.{sub_key}: {sub_key[:-1]} inputs are not read by shardtune (images "
                            "are); remove the column")
        elif sub_key not in allowed:
            problems.append(f"{where}: unknown {key} key '{sub_key}'{did_you_mean(sub_key, allowed)}; "
                            f"allowed: {', '.join(allowed)}")
        elif not isinstance(value, str):
            problems.append(f"{where}: {key}.{sub_key} must be a string, got {value!r}")
    return {**defaults, **{k: v for k, v in given.items() if isinstance(v, str) and k in allowed}}


def data_path_problems(raw: dict[str, Any], dataset_dir: Path, where: str, problems: list[str]) -> Path | None:
    """The file or folder ``file_name`` names, if it exists; otherwise append why not."""
    file_name = raw.get("file_name")
    if not isinstance(file_name, str) or not file_name:
        problems.append(f"{where} needs a 'file_name' (a file or folder inside {dataset_dir})")
        return None
    url = url_problem(file_name)
    if url:
        problems.append(f"{where}: file_name {url}")
        return None
    file_path = dataset_dir / file_name
    if file_path.is_dir():
        return file_path
    if file_path.suffix.lower() not in LOADERS:
        problems.append(f"{where}: file '{file_name}' has an unsupported extension; "
                        f"use one of {', '.join(LOADERS)}")
        return None
    if not file_path.is_file():
        problems.append(f"{where}: file {shown(str(file_path), quote=False)} does not exist")
        return None
    return file_path
