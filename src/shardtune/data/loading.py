"""Reading dataset files (json, jsonl, csv, parquet) through ``datasets``, with readable errors.

pyarrow's parse errors name a byte offset at best, so when a JSON file fails to load we scan it
ourselves and report the file and line number of the first bad records.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import numpy as np
from datasets import Dataset, load_dataset

from shardtune.data.peek import (  # noqa: F401 - peek_columns re-exported
    MAX_LISTED,
    innermost_message,
    jsonl_problems,
    peek_columns,
)
from shardtune.data.record_places import json_array_records, utf8_problem
from shardtune.data.registry import DatasetEntry
from shardtune.errors import DataError


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
