"""Keys spelled as LLaMA-Factory or the Hugging Face Trainer spell them, translated into shardtune's own.

A file written for LLaMA-Factory runs unchanged: each key here is rewritten into shardtune keys (``MAPPED``)
before the config is built, so the rest of shardtune sees one spelling. Keys shardtune cannot honour are refused
with the reason and what to do (``schema.UNSUPPORTED_KEYS``); nothing is silently ignored. ``shardtune
convert-config`` prints, for every key of a file, which of the three it is.

To add a spelling: write a function ``(value, all_values) -> {shardtune key: value}`` and register it in
``MAPPED`` with a one-line description of what it becomes. A translation may raise ``ValueError`` with a message
that names the key; it is reported with the other problems of the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Translate = Callable[[Any, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Mapped:
    """A key rewritten into shardtune keys; ``becomes`` says into what, for ``convert-config``."""

    becomes: str
    translate: Translate


def _rename(target: str) -> Translate:
    return lambda value, _values: {target: value}


# Another spelling -> what it becomes. Grouped as the schema is; each group is owned by the code that honours it.
MAPPED: dict[str, Mapped] = {
    # --- training arguments of the Hugging Face Trainer ---
    "evaluation_strategy": Mapped("eval_strategy (its newer name)", _rename("eval_strategy")),
}


def translate_keys(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` with every mapped key rewritten; (result, problems). A key given in both spellings is a problem
    unless both say the same."""
    result = {key: value for key, value in values.items() if key not in MAPPED}
    problems: list[str] = []
    for key, value in values.items():
        if key not in MAPPED:
            continue
        try:
            produced = MAPPED[key].translate(value, values)
        except ValueError as err:
            problems.append(str(err))
            continue
        for target, new in produced.items():
            if target in result and result[target] != new:
                problems.append(f"key '{key}' ({value!r}) contradicts '{target}' ({result[target]!r}); keep one")
                continue
            result[target] = new
    return result, problems
