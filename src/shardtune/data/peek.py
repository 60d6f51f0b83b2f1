"""A cheap look at a data file: its first record's columns and line-level JSON problems (no ``datasets``).

Used on the launching host before any process starts, and by the loader to explain a file it cannot parse.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from shardtune.data.lf_v1_data import first_record as first_jsonl_record
from shardtune.data.record_places import utf8_problem

MAX_LISTED = 5  # bad lines or records listed before "... and N more"
PEEK_JSON_BYTES = 8 * 1024 * 1024  # a .json array is parsed whole to peek at it, so only small ones


def innermost_message(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    return (lines[0] if lines else type(err).__name__)[:300]


def jsonl_problems(path: Path, lines: list[str]) -> list[str]:
    """Every line must hold one JSON object; report the first few that do not."""
    problems = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(f"{path} line {number}: not valid JSON ({err.msg}, column {err.colno})")
            continue
        if not isinstance(value, dict):
            problems.append(f"{path} line {number}: expected one JSON object per line, got {type(value).__name__}")
    if len(problems) > MAX_LISTED:
        problems = problems[:MAX_LISTED] + [f"{path}: ... and {len(problems) - MAX_LISTED} more bad lines"]
    return problems


def peek_columns(path: Path) -> tuple[list[str] | None, list[str]]:
    """Column names of the first record, read cheaply; (None, []) when that would mean parsing a big file."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as handle:
                return next(csv.reader(handle), []), []
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names), []
        if suffix == ".json":
            return json_file_keys(path) if path.stat().st_size <= PEEK_JSON_BYTES else (None, [])
        return first_line_keys(path)
    except UnicodeDecodeError:
        return None, [utf8_problem(path) or f"{path}: not valid UTF-8"]
    except (OSError, ValueError) as err:
        return None, [f"{path}: cannot be read ({innermost_message(err)})"]


def first_record(path: Path) -> Any:
    """The first record of a JSON-lines file or of a JSON array small enough to peek at; None when it cannot be
    read cheaply (the loader names an unreadable file with its line)."""
    try:
        if path.suffix.lower() == ".json" and path.stat().st_size <= PEEK_JSON_BYTES:
            text = path.read_text(encoding="utf-8")
            if text.lstrip().startswith("["):
                records = json.loads(text)
                return records[0] if isinstance(records, list) and records else None
        return first_jsonl_record(path)
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def json_file_keys(path: Path) -> tuple[list[str] | None, list[str]]:
    """Keys of the first record of a .json file: a JSON array, or JSON lines under a .json name."""
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        return first_line_keys(path)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        return None, [f"{path} line {err.lineno}: not valid JSON ({err.msg}, column {err.colno})"]
    if not records:
        return None, [f"{path}: no records; add records or remove the dataset"]
    if not isinstance(records[0], dict):
        return None, [f"{path}: expected a JSON array of objects, got a {type(records[0]).__name__} first"]
    return list(records[0]), []


def first_line_keys(path: Path) -> tuple[list[str] | None, list[str]]:
    """Keys of the first record of a JSON-lines file (also used for .json files that hold JSON lines)."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                problems = jsonl_problems(path, [""] * (number - 1) + [line])
                return (None, problems) if problems else (list(json.loads(line)), [])
    return None, [f"{path}: no records; add records or remove the dataset"]
