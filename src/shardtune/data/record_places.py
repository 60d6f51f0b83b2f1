"""Where a record stands in its file, so that a problem with record N names the line a user opens.

Only parsed when a problem is reported: the line each record of a JSON-lines, JSON-array or CSV file starts on,
and the first byte that is not UTF-8.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path


def utf8_problem(path: Path) -> str | None:
    """``path line L: not valid UTF-8 (...)`` for the first undecodable byte; None when the file decodes."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        return (f"{path} line {line}: not valid UTF-8 (byte 0x{data[err.start]:02x} at column {column}); save the "
                "file as UTF-8")
    return None


def record_lines(path: Path) -> list[int]:
    """The 1-based line on which each record of ``path`` starts (empty when the format is not line-based or the
    file does not parse)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return csv_record_lines(text)
    if suffix in (".json", ".jsonl") and text.lstrip().startswith("["):
        return [line for line, _ in json_array_records(text)]
    if suffix in (".json", ".jsonl"):
        return [number for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    return []


def json_array_records(text: str) -> list[tuple[int, object]]:
    """(line, value) of every element of the JSON array ``text``; empty when it does not parse."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    found: list[tuple[int, object]] = []
    try:
        while True:
            position = _skip_blank(text, position)
            if text[position] == "]":
                return found
            value, end = decoder.raw_decode(text, position)
            found.append((text.count("\n", 0, position) + 1, value))
            position = _skip_blank(text, end)
            if text[position] == ",":
                position += 1
    except (ValueError, IndexError):
        return []


def _skip_blank(text: str, position: int) -> int:
    while text[position] in " \t\r\n":
        position += 1
    return position


def csv_record_lines(text: str) -> list[int]:
    """Line of each data row (the header is line 1; a quoted field may span lines)."""
    reader = csv.reader(io.StringIO(text, newline=""))
    next(reader, None)
    starts, line = [], reader.line_num + 1
    for _ in reader:
        starts.append(line)
        line = reader.line_num + 1
    return starts
