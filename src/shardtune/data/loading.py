"""Reading dataset files (json, jsonl, csv, parquet) through ``datasets``, with readable errors.

pyarrow's parse errors name a byte offset at best, so when a JSON file fails to load we scan it
ourselves and report the file and line number of the first bad records.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
from pathlib import Path

import numpy as np
from datasets import Dataset, load_dataset

from shardtune.data.record_places import json_array_records, utf8_problem
from shardtune.data.registry import DatasetEntry
from shardtune.errors import DataError

MAX_LISTED = 5  # bad lines or records listed before "... and N more"
PEEK_JSON_BYTES = 8 * 1024 * 1024  # a .json array is parsed whole to peek at it, so only small ones


def load_records(entry: DatasetEntry, max_samples: int | None = None, seed: int = 42) -> Dataset:
    """Load the raw records of one registry entry.

    As in LLaMA-Factory: the entry's ``num_samples`` draws that many records first, then ``max_samples`` keeps
    at most that many from the start.
    """
    try:
        with quiet_datasets_logging():
            records = load_dataset(entry.loader, data_files=[str(f) for f in entry.data_files], split="train")
    except Exception as err:  # datasets wraps parser failures in several exception types
        raise DataError(*files_read_problems(entry, err)) from err
    if len(records) == 0:
        raise DataError(f"{entry.path}: no records (dataset '{entry.name}'); add records or remove the dataset")
    if entry.num_samples is not None:
        records = records.select(sample_indices(len(records), entry.num_samples, seed))
    if max_samples is not None and len(records) > max_samples:
        records = records.select(range(max_samples))
    return records


def sample_indices(size: int, count: int, seed: int) -> list[int]:
    """``count`` record indices out of ``size``: every record once (shuffled) while it lasts, then records drawn
    with replacement for the rest - so up-sampling keeps all records and adds repeats, as LLaMA-Factory does."""
    rng = np.random.default_rng(seed)
    indices = rng.permutation(size)[:count].tolist()
    if count > size:
        indices += rng.integers(0, size, count - size).tolist()
    return indices


@contextlib.contextmanager
def quiet_datasets_logging():
    """datasets logs a parser traceback before raising; our DataError names the file and line instead."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def files_read_problems(entry: DatasetEntry, err: BaseException) -> list[str]:
    """Why the entry's files could not be loaded: line-level JSON problems of any file, else the parser's."""
    if entry.loader == "json":
        problems = [p for f in entry.data_files for p in json_syntax_problems(f)]
        if problems:
            return problems[:MAX_LISTED]
    return [f"{entry.path}: cannot be read as {entry.loader} ({innermost_message(err)}); "
            "check the file's format and encoding"]


def read_problems(path: Path, loader: str, err: BaseException) -> list[str]:
    """Explain why ``path`` could not be loaded, preferring our own line-level JSON diagnosis."""
    if loader == "json":
        problems = json_syntax_problems(path)
        if problems:
            return problems
    return [f"{path}: cannot be read as {loader} ({innermost_message(err)}); check the file's format and encoding"]


def innermost_message(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    return (lines[0] if lines else type(err).__name__)[:300]


def json_syntax_problems(path: Path) -> list[str]:
    """Line-numbered syntax problems of a JSON array file or a JSON-lines file (empty if it parses)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return [utf8_problem(path) or f"{path}: not valid UTF-8"]
    except OSError as err:
        return [f"{path}: cannot be read ({err.strerror or err})"]
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return [f"{path} line {err.lineno}: not valid JSON ({err.msg}, column {err.colno})"]
        return [f"{path} record {number} (line {line}): expected a JSON object, got {type(value).__name__}"
                for number, (line, value) in enumerate(json_array_records(text), start=1)
                if not isinstance(value, dict)][:MAX_LISTED]
    return jsonl_problems(path, text.splitlines())


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
