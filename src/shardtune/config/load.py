"""Load a config from YAML plus ``key=value`` / ``--key value`` overrides into a typed ``TrainConfig``.

Every problem is collected and raised together as one ``ConfigError`` so a user fixes them in one go.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shardtune.config.compat import translate_keys
from shardtune.config.refused import REFUSED_REASONS, REFUSED_VALUES, UNSUPPORTED_KEYS
from shardtune.config.schema import TrainConfig, config_fields
from shardtune.errors import ConfigError
from shardtune.paths import ascii_lookalike, expand_user_path, shown, unusual_characters

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"null", "none", "~", ""}


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (or JSON) mapping; syntax errors and repeated keys name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loader = _UniqueKeyLoader(path.read_text(encoding="utf-8"))
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {err.problem}") from None
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"{path}: cannot read as YAML: {err}") from None
    if loader.repeated:
        repeated = sorted(loader.repeated, key=lambda r: r[2])  # nested mappings are built after their parent
        raise ConfigError(*(f"{path}:{line}: key '{key}' is given twice (first on line {first}); YAML would "
                            "silently keep the last value: keep one" for key, first, line in repeated))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of key: value, got {type(data).__name__}")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that records every key repeated within one mapping (PyYAML keeps the last one silently)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.repeated: list[tuple[str, int, int]] = []  # key, first line, repeated line (1-based)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then overriding a key is YAML's own way of reusing a block
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_lines:
                    self.repeated.append((str(key), first_lines[key], line))
                else:
                    first_lines[key] = line
            except TypeError:
                pass  # an unhashable key: SafeLoader itself reports it below
        return super().construct_mapping(node, deep=deep)


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` from the command line; the value is read as YAML (so lists and numbers work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"cannot read override '{text}': expected key=value")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().replace("-", "_"), value


def build_config(values: dict[str, Any], source: str = "config") -> TrainConfig:
    """Check and convert raw values into a ``TrainConfig``; raise one ConfigError listing every problem."""
    config, problems = build_config_collecting(values, source)
    if problems:
        raise ConfigError(*(problem.text for problem in problems))
    return config


@dataclass(frozen=True)
class KeyProblem:
    """A key whose value could not be used (``key`` None: a problem of the file's keys as a whole)."""

    key: str | None
    text: str


def build_config_collecting(values: dict[str, Any], source: str = "config",
                            where: dict[str, str] | None = None) -> tuple[TrainConfig, list[KeyProblem]]:
    """The config from every key that converts (the default for each one that does not), and the problems.

    ``where``: the place each key was given (``cfg.yaml:12``, ``command line``), named in its problem instead of
    ``source``. The launching host goes on to check the other rules on this config so that a user sees everything
    in one round; a rule about a key listed here judges the default, not the user's value, and is left out then.
    """
    fields = {f.name: f for f in config_fields()}
    hints = typing.get_type_hints(TrainConfig)
    values, translation = translate_keys(values)  # LLaMA-Factory and Trainer spellings -> shardtune keys
    problems = [KeyProblem(None, f"{source}: {p}") for p in translation]
    converted: dict[str, Any] = {}
    for key, raw in values.items():
        place = (where or {}).get(str(key), source)
        if key not in fields:
            problems.append(KeyProblem(str(key), f"{place}: {unknown_key_message(str(key), list(fields))}"))
            continue
        try:
            converted[key] = coerce_value(key, raw, hints[key], fields[key].metadata)
        except ValueError as err:
            problems.append(KeyProblem(key, f"{place}: {err}"))
    return TrainConfig(**converted), problems


def yaml_key_lines(path: str | Path) -> dict[str, int]:
    """The line of each top-level key of a YAML file that ``load_yaml_file`` has read (1-based)."""
    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return {}
    if not isinstance(root, yaml.MappingNode):
        return {}
    lines: dict[str, int] = {}
    for key_node, _ in root.value:
        if isinstance(key_node, yaml.ScalarNode):
            lines.setdefault(str(key_node.value), key_node.start_mark.line + 1)
    return lines


def unknown_key_message(key: str, known: list[str]) -> str:
    if key in REFUSED_REASONS:
        return f"key '{key}' is not supported by shardtune: {REFUSED_REASONS[key]}"
    if key in UNSUPPORTED_KEYS:
        return f"key '{key}' is not supported by shardtune (remove it; it would have no effect)"
    close = difflib.get_close_matches(ascii_lookalike(key), known, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else ""
    odd = unusual_characters(key)
    if odd:  # a key that looks right but is not: say which characters are not what they seem
        return f"unknown key {repr(key)} (it contains {'; '.join(odd)}{'; ' + hint if hint else ''})"
    return f"unknown key '{key}'" + (f" ({hint})" if hint else "")



def coerce_value(key: str, raw: Any, hint: Any, meta: typing.Mapping[str, Any]) -> Any:
    """Convert ``raw`` to the declared type and check choices and bounds; ValueError names the key."""
    raw = _joined_surrogates(raw)
    choices = meta.get("choices")
    if isinstance(raw, bool) and choices and "no" in choices:
        raw = "yes" if raw else "no"  # YAML 1.1 reads `save_strategy: no` as false
    value = _convert(key, raw, hint)
    if isinstance(value, str) and value in REFUSED_VALUES.get(key, {}):
        raise ValueError(f"{key}: {value!r} is not supported by shardtune: {REFUSED_VALUES[key][value]}")
    if choices is not None and value not in choices:
        allowed = ", ".join("null" if c is None else str(c) for c in choices)
        raise ValueError(f"{key}: {shown(raw) if isinstance(raw, str) else repr(raw)} is not allowed; choose one of: "
                         f"{allowed}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key}: {raw!r} is not a finite number; give a number")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_bounds(key, value, meta)
    if meta.get("path"):
        try:
            value = _expanded(value, hub_id_too=key in HUB_ID_KEYS)
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None
    return value


def _joined_surrogates(raw: Any) -> Any:
    """A YAML/JSON ``"\\ud800\\udc00"`` escape arrives as two UTF-16 halves; join them into the character they
    spell (lone halves stay, for the checks to name)."""
    if isinstance(raw, str) and any("\ud800" <= c <= "\udfff" for c in raw):
        return raw.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")
    return raw


# Path keys that also take a model's hub id (org/name): a URL there is told the id it holds.
HUB_ID_KEYS = ("model_name_or_path", "ref_model")


def _expanded(value: Any, hub_id_too: bool) -> Any:
    """``~`` and ``$VAR`` in a path key (a list of paths: each; a mapping: left as it is); a URL is refused here,
    once for every path key."""
    if isinstance(value, str):
        return expand_user_path(value, hub_id_too)
    if isinstance(value, list):
        return [expand_user_path(v, hub_id_too) for v in value]
    return value


def _check_bounds(key: str, value: float, meta: typing.Mapping[str, Any]) -> None:
    low, high = meta.get("minimum"), meta.get("maximum")
    if low is not None and (value < low or (meta.get("exclusive_minimum") and value == low)):
        relation = ">" if meta.get("exclusive_minimum") else ">="
        raise ValueError(f"{key}: {value} is out of range; it must be {relation} {low}")
    if high is not None and value > high:
        raise ValueError(f"{key}: {value} is out of range; it must be <= {high}")


def _convert(key: str, raw: Any, hint: Any) -> Any:
    options = _union_members(hint)
    if type(None) in options and (raw is None or (isinstance(raw, str) and raw.strip().lower() in _NONE)):
        return None
    for option in options:
        if option is type(None):
            continue
        try:
            return _convert_to(raw, option)
        except (TypeError, ValueError):
            continue
    names = " or ".join(_type_name(o) for o in options)
    raise ValueError(f"{key}: expected {names}, got {raw!r}")


def _union_members(hint: Any) -> tuple[Any, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _convert_to(raw: Any, target: Any) -> Any:
    origin = typing.get_origin(target) or target
    if origin is bool:
        return _to_bool(raw)
    if origin is int:
        return _to_int(raw)
    if origin is float:
        if isinstance(raw, bool):
            raise TypeError
        return float(raw)
    if origin is list:
        return _to_list(raw)
    if origin is dict:
        return _to_dict(raw)
    if origin is str:
        if isinstance(raw, (dict, list, bool)) or raw is None:
            raise TypeError
        return str(raw)
    raise TypeError(f"unsupported type {target}")


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise TypeError
    if isinstance(raw, float):
        if not raw.is_integer():
            raise ValueError
        return int(raw)
    return int(str(raw).strip())


def _to_list(raw: Any) -> list[str]:
    if isinstance(raw, str):
        return [part.strip() for part in raw.split(",") if part.strip()]
    if isinstance(raw, (list, tuple)) and all(isinstance(x, (str, int, float)) for x in raw):
        return [str(x) for x in raw]
    raise TypeError


def _to_dict(raw: Any) -> dict:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str) and raw.strip().startswith("{"):
        return json.loads(raw)
    raise TypeError


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint) or hint
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", type(None): "null"}.get(origin, str(hint))


def type_label(hint: Any) -> str:
    """Short type description for --help and the generated key reference."""
    return " | ".join(
        {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "mapping",
         type(None): "null"}.get(typing.get_origin(o) or o, str(o))
        for o in _union_members(hint)
    )


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain mapping of every key (for writing the resolved config)."""
    return dataclasses.asdict(config)
