"""Errors a user can fix: the CLI turns them into one line each and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable


class ShardtuneError(Exception):
    """A mistake in the user's input (config, data, model path, launch settings).

    ``problems`` holds one line per problem so that all of them are shown at once.
    """

    exit_code = 2

    def __init__(self, *problems: str) -> None:
        self.problems = [p for p in problems if p]
        super().__init__("\n".join(self.problems))


class ConfigError(ShardtuneError):
    """A config key is unknown, mistyped, out of range, or conflicts with another key."""


class DataError(ShardtuneError):
    """A dataset name, file, record or template cannot be used."""


class ModelError(ShardtuneError):
    """A model directory, checkpoint or quantization setting cannot be used."""


def report_error(err: ShardtuneError) -> int:
    """Print one line per problem on stderr; return the exit code for it."""
    for problem in err.problems:
        write_stderr_line(f"shardtune: error: {one_line(problem)}")
    return err.exit_code


# Characters that end a line for str.splitlines() (and for readers that split as it does) or that a terminal does
# not show: a value holding one would break the message into lines or hide its culprit.
_LINE_BREAKING = {"\r": "\\r", "\n": "\\n", "\t": "\t"}


def one_line(text: str) -> str:
    """``text`` on one visible line, whatever a value in it holds (a path ending in "\\r" from a Windows file, a
    control character in a key's value): line breaks and other control characters are written as escapes."""
    if text.isprintable():
        return text
    return "".join(_LINE_BREAKING.get(char, char if char.isprintable() else f"\\x{ord(char):02x}"
                                       if ord(char) < 0x100 else f"\\u{ord(char):04x}") for char in text)


def write_stderr_line(line: str) -> None:
    """``line`` and its newline in one write: ranks share torchrun's stderr pipe, and print() writes the text and
    the newline separately, so another rank's line could land between them (a pipe write this short is atomic)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def debug_requested(args: list[str]) -> bool:
    """`--debug` or SHARDTUNE_DEBUG=1: show tracebacks and every process's raw output."""
    import os

    return "--debug" in args or os.environ.get("SHARDTUNE_DEBUG") == "1"


def run_reporting_errors(handler: Callable[[list[str]], int], args: list[str]) -> int:
    """Run a command: user mistakes become one line per problem and exit code 2; tracebacks only with --debug."""
    try:
        return handler(args)
    except ShardtuneError as err:
        if debug_requested(args):
            raise
        return report_error(err)
    except KeyboardInterrupt:
        print("shardtune: interrupted", file=sys.stderr)
        return 130
    except OSError as err:  # a path the user gave that cannot be read or written: one line, not a traceback
        if err.filename is None or debug_requested(args):
            raise
        return report_error(ShardtuneError(path_error_text(err)))


def path_error_text(err: OSError) -> str:
    """One line for an OSError about a path: the path, the reason, and the fix where the path is a URL."""
    name = str(err.filename)
    if "://" in name or name.startswith(("http:/", "https:/", "s3:/", "gs:/")):
        return f"{name} is a URL; shardtune reads and writes local paths: give a folder on this machine"
    target = f" -> {err.filename2}" if err.filename2 else ""
    return f"{name}{target}: {err.strerror or err}; give a path that can be used there"
