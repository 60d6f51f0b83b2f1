"""The launch form's fields, from the config schema: one per key, with its group, type, default, choices, range and
one-line doc (the same declarations `shardtune keys` prints)."""

from __future__ import annotations

from typing import Any

from shardtune.config.reference import key_rows
from shardtune.config.schema import GROUP_TITLES, config_fields


def form_fields() -> list[dict[str, Any]]:
    meta = {f.name: f.metadata for f in config_fields()}
    fields = []
    for group, key, kind, default, doc in key_rows():
        m = meta[key]
        fields.append({"group": GROUP_TITLES.get(group, group), "key": key, "type": _input_type(kind),
                       "type_label": kind, "default": default, "doc": doc,
                       "choices": [("null" if c is None else str(c)) for c in m.get("choices") or ()] or None,
                       "minimum": m.get("minimum"), "maximum": m.get("maximum")})
    return fields


def _input_type(kind: str) -> str:
    lowered = kind.lower()
    if lowered.startswith("bool"):
        return "bool"
    if lowered.startswith(("int", "float")):
        return "number"
    return "text"

