"""Human-readable key reference, generated from the schema (for --help and docs/config.md)."""

from __future__ import annotations

import typing
from collections.abc import Collection

from shardtune.config.load import type_label
from shardtune.config.schema import GROUP_TITLES, TrainConfig, config_fields


def _default_text(field) -> str:
    import dataclasses

    if field.default is not dataclasses.MISSING:
        value = field.default
    else:
        value = field.default_factory()
    if isinstance(value, list):
        return ",".join(value) if value else "(empty)"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def key_rows() -> list[tuple[str, str, str, str, str]]:
    """(group, key, type, default, doc) for every key."""
    hints = typing.get_type_hints(TrainConfig)
    rows = []
    for f in config_fields():
        doc = f.metadata["doc"]
        if f.metadata.get("choices"):
            doc += " [" + "|".join("null" if c is None else str(c) for c in f.metadata["choices"]) + "]"
        rows.append((f.metadata["group"], f.name, type_label(hints[f.name]), _default_text(f), doc))
    return rows


def help_text(keys: Collection[str] | None = None) -> str:
    """Every key (or those of ``keys``) by group, one line each: name, type, default and doc."""
    lines: list[str] = []
    for group, title in GROUP_TITLES.items():
        rows = [row for row in key_rows() if row[0] == group and (keys is None or row[1] in keys)]
        if rows:
            lines.append(f"\n{title}:")
        lines += [f"  {key:<30} {kind:<14} default {default:<12} {doc}" for _, key, kind, default, doc in rows]
    return "\n".join(lines)


def markdown_reference() -> str:
    out = ["# Config keys", "",
           "Generated from `src/shardtune/config/schema.py` by `shardtune keys --markdown`; do not edit by hand.",
           ""]
    for group, title in GROUP_TITLES.items():
        out += [f"## {title}", "", "| key | type | default | description |", "|---|---|---|---|"]
        for g, key, kind, default, doc in key_rows():
            if g == group:
                out.append(f"| `{key}` | {kind.replace(' | ', ' or ')} | `{default}` | {doc.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)
