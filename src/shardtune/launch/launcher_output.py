"""The launching host's view of torchrun's stderr, which torchrun and every rank on this node share.

When a rank fails, torchrun adds its own account to the rank's one-line report: a log line per stopped rank
and a ChildFailedError traceback with a failure table. Both say less than the report, so they are dropped
(the table is read first, for a summary when no rank could report), and a report that several ranks print
alike is shown once. Everything else, progress bars included, passes through as it arrives.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import signal
from dataclasses import dataclass
from typing import TextIO

from shardtune.launch.failures import REPORT_PREFIX, WatchdogReport, read_watchdog_line, strongest

_TRACEBACK = "Traceback (most recent call last):"
_REPORT = re.compile(re.escape(REPORT_PREFIX) + r"\d+ failed: ")
_OUR_ERROR = "shardtune: error: "
_OUR_NOTICE = "[shardtune] "  # e.g. "[shardtune] SIGTERM: stopping after this step"
# torchrun's log lines about stopping ranks after a failure, e.g.
# "W1122 18:21:41.082000 27381 .../torch/distributed/elastic/multiprocessing/api.py:1028] Sending process ..."
_TORCHRUN_LOG = re.compile(r"[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/elastic/\S+\] ")
_TEARDOWN = ("Sending process", "failed (exitcode:", "Unable to shutdown process")
_FAILURE_FIELD = re.compile(r"^\s*(rank|exitcode)\s*: (-?\d+)")


@dataclass(frozen=True)
class RankExit:
    """One row of torchrun's failure table."""

    rank: int
    exit_code: int

    @property
    def stopped_by_torchrun(self) -> bool:
        return self.exit_code == -signal.SIGTERM

    @property
    def aborted(self) -> bool:
        """SIGABRT: on GPUs usually NCCL's watchdog taking the process down."""
        return self.exit_code == -signal.SIGABRT

    def describe(self) -> str:
        if self.exit_code >= 0:
            return f"rank {self.rank} exited with code {self.exit_code}"
        try:
            name = signal.Signals(-self.exit_code).name
        except ValueError:
            name = f"signal {-self.exit_code}"
        hint = " (on Linux usually the out-of-memory killer)" if name == "SIGKILL" else ""
        return f"rank {self.rank} was killed by {name}{hint}"


class LauncherOutput:
    """Feed it torchrun's stderr as it arrives; it returns what the user should see."""

    def __init__(self) -> None:
        self._partial = ""
        self._held: list[str] = []        # a traceback held until its exception line shows whose it is
        self._in_failure_table = False    # torchrun's ChildFailedError: everything after it is dropped
        self._failed: list[RankExit] = []
        self._root_cause_from = 0         # index in _failed where torchrun's "Root Cause" rows start
        self._row_rank: int | None = None
        self._seen_reports: set[str] = set()
        self._line_open = False           # the text shown last did not end its line (a progress bar)
        self._watchdog: list[WatchdogReport] = []

    @property
    def any_rank_reported(self) -> bool:
        return bool(self._seen_reports)

    def feed(self, text: str) -> str:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        shown = "".join(self._emit(self._line(line + "\n")) for line in lines)
        if "\r" in self._partial and not (self._held or self._in_failure_table):
            # A progress bar redraws its line with \r and ends it only when done: show it now, up to where a
            # line we may have to drop could be starting.
            cut = _safe_prefix_length(self._partial)
            shown, self._partial = shown + self._emit(self._partial[:cut]), self._partial[cut:]
        return shown

    def _emit(self, text: str) -> str:
        """A report starts on a line of its own, even when a progress bar left the last one open."""
        if self._line_open and text.startswith((REPORT_PREFIX, _OUR_ERROR)):
            text = "\n" + text
        if text:
            self._line_open = not text.endswith("\n")
        return text

    def finish(self) -> str:
        """Whatever is still held when the stream ends (a traceback that was not torchrun's)."""
        rest = self.feed("\n") if self._partial else ""
        held, self._held = "".join(self._held), []
        return rest + ("" if self._in_failure_table else held)

    def watchdog_report(self, cause: RankExit | None = None) -> str | None:
        """The line for a rank NCCL's watchdog ended (``cause``'s own, else the first), None when none logged."""
        reports = strongest(self._watchdog)
        own = [r for r in reports if cause is not None and r.rank == cause.rank]
        return (own or reports)[0].line() if reports else None

    def failed_ranks(self) -> list[RankExit]:
        """torchrun's failure table, the first observed failure first; empty when torchrun printed none."""
        root = self._failed[self._root_cause_from:]
        return root + [e for e in self._failed[:self._root_cause_from] if e not in root]

    def add_failures(self, exits: list[RankExit]) -> None:
        """Failures known otherwise than from torchrun's table (ranks the rank server ran), the first one first."""
        self._failed[self._root_cause_from:self._root_cause_from] = exits

    def _line(self, line: str) -> str:
        report = read_watchdog_line(line)
        if report is not None:
            self._watchdog.append(report)
        if self._in_failure_table:
            self._read_failure_table(line)
            return ""
        if self._held:
            return self._continue_traceback(line)
        cut = _first_marker(line, after=1)
        if cut > 0:
            # Another rank's progress bar, or a rank's own line cut short by its signal handler's notice, left the
            # line open: end it there and read both parts as lines.
            return self._line(line[:cut] + "\n") + self._line(line[cut:])
        if line.startswith(_TRACEBACK):
            self._held = [line]
            return ""
        return self._dedupe(line)

    def _continue_traceback(self, line: str) -> str:
        if line.startswith((" ", "\t")):
            self._held.append(line)
            return ""
        held, self._held = "".join(self._held), []
        if "ChildFailedError" in line:
            self._in_failure_table = True
            return ""
        return held + self._line(line)

    def _dedupe(self, line: str) -> str:
        match = _TORCHRUN_LOG.match(line)
        if match and line[match.end():].startswith(_TEARDOWN):
            return ""
        if _REPORT.match(line) or line.startswith(_OUR_ERROR):
            # Several ranks hitting the same problem report it alike: show it once.
            key = re.sub(r"rank[- ]\d+", "rank N", line)
            if key in self._seen_reports:
                return ""
            self._seen_reports.add(key)
        return line

    def _read_failure_table(self, line: str) -> None:
        if line.startswith("Root Cause"):
            self._root_cause_from = len(self._failed)
        field = _FAILURE_FIELD.match(line)
        if field and field.group(1) == "rank":
            self._row_rank = int(field.group(2))
        elif field and self._row_rank is not None:
            self._failed.append(RankExit(self._row_rank, int(field.group(2))))
            self._row_rank = None


def _first_marker(line: str, after: int) -> int:
    """Where the first line of interest to the filter starts inside ``line`` at or after ``after`` (-1: none)."""
    found = [line.find(REPORT_PREFIX, after), line.find(_OUR_ERROR, after), line.find(_OUR_NOTICE, after)]
    header = line.find(_TRACEBACK, after)
    if not line[:header].endswith("]: "):  # "[rank1]: Traceback": torch's prefix on a rank's own traceback
        found.append(header)
    log = _TORCHRUN_LOG.search(line, after)
    if log:
        found.append(log.start())
    return min((i for i in found if i >= 0), default=-1)


def _safe_prefix_length(text: str) -> int:
    """How much of an unfinished line can be shown before a marker (or the first part of one) begins."""
    cut = len(text)
    for marker in (REPORT_PREFIX, _OUR_ERROR, _TRACEBACK):
        found = text.find(marker)
        if found >= 0:
            cut = min(cut, found)
        for size in range(len(marker) - 1, 0, -1):
            if text.endswith(marker[:size]):
                cut = min(cut, len(text) - size)
                break
    return cut


def pump(fd: int, output: LauncherOutput, sink: TextIO) -> None:
    """Copy the pipe ``fd`` to ``sink`` through ``output`` until the pipe closes (run in a thread).

    Never stops early: ranks writing to a pipe nobody drains would block. A filter bug shows the raw rest.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    filtering = True
    while chunk := os.read(fd, 65536):
        text = decoder.decode(chunk)
        if filtering:
            try:
                text = output.feed(text)
            except Exception:  # noqa: BLE001
                filtering = False
        _write(sink, text)
    if filtering:
        _write(sink, output.feed(decoder.decode(b"", final=True)) + output.finish())


def _write(sink: TextIO, text: str) -> None:
    if text:
        with contextlib.suppress(OSError, ValueError):  # a closed terminal must not stop the draining
            sink.write(text)
            sink.flush()
