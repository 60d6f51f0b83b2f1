"""The subcommands' option parsing, shared (a leaf module: the standard library only): a mistake is one line that
names the option and exit code 2, like every other user error, and numbers are checked against their range."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from typing import NoReturn


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose error is one line naming the option and pointing to --help (not the whole usage)."""

    def error(self, message: str) -> NoReturn:
        hint = self._closest_option(message)
        sys.stderr.write(f"{self.prog}: error: {message} ({hint}`{self.prog} --help` lists the options)\n")
        sys.exit(2)

    def _closest_option(self, message: str) -> str:
        """'did you mean '--out'?; ' for the first unrecognized option close to one this command has."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        options = [o for o in self._option_string_actions if o.startswith("--")]
        for word in message.split(":", 1)[1].split():
            close = difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.6)
            if word.startswith("--") and close:
                return f"did you mean '{close[0]}'?; "
        return ""


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An option type: an integer from ``low`` (to ``high``); argparse names the option when it is not."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            bound = f"{low} to {high}" if high is not None else f"{low} or more"
            raise argparse.ArgumentTypeError(f"{value} is out of range; give {bound}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An option type: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is out of range; give a number of seconds above 0")
    return value
