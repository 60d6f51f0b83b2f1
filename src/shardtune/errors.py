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
        # One line each, whatever a value in the message holds (a path ending in "\r" from a Windows file).
        line = problem.replace("\r", "\\r").replace("\n", "\\n")
        write_stderr_line(f"shardtune: error: {line}")
    return err.exit_code


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
