"""``shardtune convert-config``: what shardtune does with every key of a LLaMA-Factory (or Trainer) YAML file.

Each key is one of: honoured (a shardtune key of the same name), mapped (another spelling, rewritten by
``config.compat``), refused (known, cannot be honoured: the reason) or unknown. The rewritten file can be written
out in shardtune's own spelling; it is the same run either way, since ``train`` applies the same translation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shardtune.config.compat import MAPPED, Refused
from shardtune.config.lf_v1 import V1_PREFIX, describe_v1_key, is_v1_file, translate_file_values, v1_defaults_for_file
from shardtune.config.load import build_config, load_yaml_file, unknown_key_message
from shardtune.config.refused import REFUSED_REASONS, UNSUPPORTED_KEYS
from shardtune.config.schema import key_names
from shardtune.errors import ConfigError
from shardtune.paths import output_file_problem

HONOURED, MAPPED_STATUS, REFUSED, UNKNOWN = "honoured", "mapped", "refused", "unknown"


@dataclass(frozen=True)
class KeyReport:
    key: str
    status: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.status:9} {self.key}" + (f": {self.detail}" if self.detail else "")


def key_reports(values: dict[str, Any]) -> list[KeyReport]:
    """One report per key of ``values``, in file order."""
    known = key_names()
    reports = []
    v1 = is_v1_file(values)
    for key in values:
        described = describe_v1_key(str(key), values) if v1 else None
        if described is not None:
            refused, detail = described
            reports.append(KeyReport(key, REFUSED if refused else MAPPED_STATUS, detail))
        elif key in MAPPED:
            reports.append(mapped_report(key, values))
        elif key in known:
            reports.append(KeyReport(key, HONOURED))
        else:
            status = REFUSED if key in UNSUPPORTED_KEYS or key in REFUSED_REASONS else UNKNOWN
            reports.append(KeyReport(key, status, unknown_key_message(str(key), known)))
    return reports


def mapped_report(key: str, values: dict[str, Any]) -> KeyReport:
    """Mapped, or refused when this file's value is one shardtune refuses for that key (``save_safetensors:
    false``); a value that is merely malformed stays mapped and shows up among the problems."""
    try:
        MAPPED[key].translate(values[key], values)
    except Refused as refused:
        return KeyReport(key, REFUSED, f"{values[key]!r}: {refused.reason}")
    except ValueError:
        pass
    return KeyReport(key, MAPPED_STATUS, f"-> {MAPPED[key].becomes}")


def validation_problems(values: dict[str, Any], source: str) -> list[str]:
    """What ``build_config`` would still refuse (types, ranges, contradictions), every problem listed."""
    try:
        build_config(values, source=source)
    except ConfigError as err:
        return list(err.problems)
    return []


def convert_config(path: Path, out: Path | None, overrides: dict[str, Any] | None = None) -> tuple[list[str], bool]:
    """(report lines, whether the file runs as it is); writes shardtune's spelling to ``out`` when given.
    ``overrides``: command-line settings over the file's keys, as ``train`` would apply them."""
    values = {**load_yaml_file(path), **(overrides or {})}
    if out is not None:
        problem = ("convert-config: --out names the file being converted; give a new file name"
                   if out.resolve() == path.resolve() else output_file_problem(out, "convert-config: --out"))
        if problem:
            raise ConfigError(problem)
    reports = key_reports(values)
    lines = [report.line() for report in reports]
    if is_v1_file(values):
        defaults = ", ".join(f"{k}: {v}" for k, v in v1_defaults_for_file(values).items())
        lines.insert(0, f"{V1_PREFIX}: read as v1 reads it, with v1's defaults for the keys it leaves out ({defaults})")
    translated, _ = translate_file_values(values)
    problems = validation_problems(translated, str(path))
    blocked = [r for r in reports if r.status in (REFUSED, UNKNOWN)]
    counts = {status: sum(r.status == status for r in reports) for status in (HONOURED, MAPPED_STATUS, REFUSED,
                                                                                 UNKNOWN)}
    lines.append(", ".join(f"{n} {status}" for status, n in counts.items()))
    lines += [f"problem: {p}" for p in problems if not any(f"'{r.key}'" in p for r in blocked)]
    if out is not None:
        kept = {k: v for k, v in translated.items() if k not in {r.key for r in blocked}}
        header = f"# Written by `shardtune convert-config` from {path.name}: its keys in shardtune's spelling.\n"
        out.write_text(header + yaml.safe_dump(kept, sort_keys=False), encoding="utf-8")
        lines.append(f"wrote {out} in shardtune's spelling ({len(kept)} keys; refused and unknown keys left out)")
    return lines, not blocked and not problems
