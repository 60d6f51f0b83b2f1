"""Turn a command line (``CONFIG.yaml key=value --key value --flag``) into config values.

Launchers inject their own arguments (the deepspeed launcher adds ``--local_rank=N``): those are
tolerated here so they can never hide the YAML path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtune.config.compat import translate_keys
from shardtune.config.lf_v1 import translate_file_values
from shardtune.config.load import KeyProblem, build_config_collecting, load_yaml_file, parse_override, yaml_key_lines
from shardtune.config.refused import names_other_backend
from shardtune.config.schema import TrainConfig, config_fields
from shardtune.errors import ConfigError

# Arguments that launchers add on their own; never config keys.
LAUNCHER_ARGS = frozenset({"local_rank", "local-rank"})
# Our own command-line switches (not config keys).
CLI_SWITCHES = frozenset({"dry_run", "debug"})
_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass
class CommandLine:
    """What a ``train``/``check`` command line asked for, before validation."""

    config_path: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    switches: set[str] = field(default_factory=set)


def parse_command_line(argv: list[str]) -> CommandLine:
    """Split argv into the config file, key=value / --key value overrides and our switches."""
    parsed = CommandLine()
    bool_keys = {f.name for f in config_fields() if f.type in ("bool", "bool | None")}
    overrides: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("--"):
            name, sep, value = arg[2:].partition("=")
            key = name.replace("-", "_")
            if name in LAUNCHER_ARGS:
                if not sep and i < len(argv) and not argv[i].startswith("-"):
                    i += 1
                continue
            if key in CLI_SWITCHES:
                parsed.switches.add(key)
                continue
            if not sep:
                has_value = i < len(argv) and not argv[i].startswith("--")
                if key in bool_keys and (not has_value or argv[i].lower() not in _BOOL_WORDS):
                    overrides.append((key, True))
                    continue
                if not has_value:
                    raise ConfigError(f"command line: --{name} needs a value")
                value = argv[i]
                i += 1
            overrides.append(parse_override(f"{key}={value}"))
        elif "=" in arg and arg.partition("=")[0].isidentifier():  # a key=value (a path has / or . first)
            overrides.append(parse_override(arg))
        elif parsed.config_path is None:
            parsed.config_path = arg
        else:
            raise ConfigError(f"command line: unexpected argument '{arg}' (a second config file?)")
    parsed.values = dict(overrides)
    twice = [f"command line: {key} is given twice ({first!r} and {value!r}); keep one"
             for index, (key, value) in enumerate(overrides)
             for first in [next((v for k, v in overrides[:index] if k == key), value)] if first != value]
    if twice:
        raise ConfigError(*dict.fromkeys(twice))
    return parsed


_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def load_config(argv: list[str], defaults: dict[str, Any] | None = None) -> tuple[TrainConfig, CommandLine]:
    """Read the YAML named on the command line over ``defaults``, apply overrides, type-check everything."""
    config, cmd, problems = read_config(argv, defaults)
    if problems:
        raise ConfigError(*(problem.text for problem in problems))
    return config, cmd


def read_config(argv: list[str], defaults: dict[str, Any] | None = None
                ) -> tuple[TrainConfig, CommandLine, list[KeyProblem]]:
    """Like ``load_config``, with the keys whose values cannot be used returned instead of raised (their defaults
    stand in). A command line or file that cannot be read at all still raises."""
    cmd = parse_command_line(argv)
    values: dict[str, Any] = dict(defaults or {})
    source = "command line"
    where: dict[str, str] = {}
    spelling_problems: list[KeyProblem] = []
    if cmd.config_path is not None:
        path = cmd.config_path
        if not path.endswith(_CONFIG_SUFFIXES):
            raise ConfigError(f"command line: '{path}' is not a .yaml/.yml/.json config file")
        if Path(path).is_dir():
            raise ConfigError(f"command line: {path} is a folder; give the config file")
        file_values, file_problems = translate_file_values(load_yaml_file(path))  # v1 or v0 spelling
        values.update(file_values)
        spelling_problems += [KeyProblem(None, f"{path}: {p}") for p in file_problems]
        where.update({key: f"{path}:{line}" for key, line in yaml_key_lines(path).items()})
        source = path
    # The command line overrides the file in whichever spelling: each side is read in shardtune's spelling first.
    command_line, line_problems = translate_keys(cmd.values)
    spelling_problems += [KeyProblem(None, f"command line: {p}") for p in line_problems]
    values.update(command_line)
    where.update({key: "command line" for key in command_line})
    config, key_problems = build_config_collecting(values, source=source, where=where)
    problems = spelling_problems + key_problems
    # A file written for another back-end says so first; its other keys' problems would only distract.
    return config, cmd, sorted(problems, key=lambda problem: not names_other_backend(problem.text))
