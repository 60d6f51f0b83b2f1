"""Turn a command line (``CONFIG.yaml key=value --key value --flag``) into config values: the one grammar of every
subcommand that takes settings (``parse_subcommand`` splits a subcommand's own options from its settings).

Launchers inject their own arguments (the deepspeed launcher adds ``--local_rank=N``): those are
tolerated here so they can never hide the YAML path.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtune.config.compat import translate_keys
from shardtune.config.lf_v1 import translate_file_values
from shardtune.config.load import KeyProblem, build_config_collecting, load_yaml_file, parse_override, yaml_key_lines
from shardtune.config.refused import names_other_backend
from shardtune.config.schema import TrainConfig, config_fields, key_names
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
    bool_keys = _bool_keys()
    overrides: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("--"):
            name, sep, value = arg[2:].partition("=")
            key = name.replace("-", "_")
            takes_next = not sep and value_follows(name, argv, i, bool_keys)
            i += takes_next
            if name in LAUNCHER_ARGS:
                continue
            if key in CLI_SWITCHES:
                parsed.switches.add(key)
                continue
            if not sep:
                if key in bool_keys and not takes_next:
                    overrides.append((key, True))
                    continue
                if not takes_next:
                    raise ConfigError(f"command line: --{name} needs a value")
                value = argv[i - 1]
            overrides.append(parse_override(f"{key}={value}"))
        elif _is_key_value(arg):
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


def value_follows(name: str, argv: list[str], at: int, bool_keys: Collection[str]) -> bool:
    """Whether ``--name`` (given without ``=``) takes ``argv[at]`` as its value: a launcher's argument takes what is
    not an option, our switches nothing, a true/false key only a true/false word, any other key what follows
    unless it is a ``--`` option."""
    following = argv[at] if at < len(argv) else None
    if name in LAUNCHER_ARGS:
        return following is not None and not following.startswith("-")
    key = name.replace("-", "_")
    if key in CLI_SWITCHES or following is None or following.startswith("--"):
        return False
    return key not in bool_keys or following.lower() in _BOOL_WORDS


def parse_subcommand(parser: argparse.ArgumentParser, argv: list[str], keys: Collection[str] | None = None
                     ) -> tuple[argparse.Namespace, list[str]]:
    """A subcommand's own options, read by ``parser``, and its settings as ``key=value`` (our switches as given).

    Every ``key=value``, ``--key value`` and ``--key=value`` that is not one of the command's options is a setting,
    read as ``train`` reads its command line (``read_config``): an unknown key is one line naming the closest key,
    the same for every command. ``--help`` lists ``keys``, the config keys the command reads (None: all of them).
    """
    own, settings = split_settings(argv, parser)
    if "-h" in own or "--help" in own:
        print(parser.format_help() + "\n" + keys_help(keys))
        raise SystemExit(0)
    return parser.parse_args(own), settings


def split_settings(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(the arguments of ``parser``'s options and positionals, the settings as ``key=value``).

    A ``--name`` close to one of the command's options and to no config key stays with the options, so that
    ``parser`` names it with the option it resembles (``--outt``: did you mean '--out'?).
    """
    options = parser._option_string_actions  # argparse keeps no public table of a parser's options
    bool_keys = _bool_keys()
    own: list[str] = []
    settings: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            (settings if _is_key_value(arg) else own).append(arg)
            continue
        name, sep, value = arg[2:].partition("=")
        option = next((o for o in (f"--{name}", f"--{name.replace('_', '-')}") if o in options), None)
        if option is not None or _resembles_an_option(name, options):
            own.append(f"{option}{sep}{value}" if option else arg)
            takes_value = option is None or options[option].nargs != 0
            if takes_value and not sep and i < len(argv) and not argv[i].startswith("--"):
                own.append(argv[i])
                i += 1
            continue
        takes_next = not sep and value_follows(name, argv, i, bool_keys)
        if name in LAUNCHER_ARGS or name.replace("-", "_") in CLI_SWITCHES:
            settings += argv[i - 1:i + takes_next]
        elif sep or takes_next:
            settings.append(f"{name.replace('-', '_')}={value if sep else argv[i]}")
        else:
            settings.append(f"--{name}")  # a true/false key alone, or a key without its value (read_config says so)
        i += takes_next
    return own, settings


def _is_key_value(arg: str) -> bool:
    """``key=value`` (a path such as ``runs/a=b`` has / or . before its ``=``)."""
    return "=" in arg and arg.partition("=")[0].isidentifier()


def _bool_keys() -> set[str]:
    return {f.name for f in config_fields() if f.type in ("bool", "bool | None")}


def _resembles_an_option(name: str, options: Collection[str]) -> bool:
    """``--name`` is a typo of one of the command's options rather than of a config key."""
    key = name.replace("-", "_")
    if key in key_names() or name in LAUNCHER_ARGS or key in CLI_SWITCHES:
        return False
    spelt = "--" + name.replace("_", "-")
    close = difflib.get_close_matches(spelt, [o for o in options if o.startswith("--")], n=1, cutoff=0.8)
    if not close:
        return False
    near_key = difflib.get_close_matches(key, key_names(), n=1, cutoff=0.0)
    ratio = difflib.SequenceMatcher(None, spelt, close[0]).ratio()
    return not near_key or ratio >= difflib.SequenceMatcher(None, key, near_key[0]).ratio()


def keys_help(keys: Collection[str] | None = None) -> str:
    """The config keys a command reads, with their types, defaults and docs (for ``--help``)."""
    from shardtune.config.reference import help_text

    head = "config keys (in the YAML file, as key=value, as --key value or as --key=value):"
    return head + help_text(keys)


def read_settings(settings: list[str]) -> dict[str, Any]:
    """The values of command-line settings, each checked as ``train`` checks it (one ConfigError listing all)."""
    _, cmd, problems = read_config(settings)
    if cmd.config_path is not None:
        problems.insert(0, KeyProblem(None, f"command line: unexpected argument '{cmd.config_path}'"))
    if problems:
        raise ConfigError(*(problem.text for problem in problems))
    return cmd.values


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
