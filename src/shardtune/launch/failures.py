"""What a rank does when training fails: one line for the user, the full traceback in a file.

A failing rank takes its peers down with it: their next collective sees the connection close (or, when the
rank hangs instead, waits until ``ddp_timeout``). Printing every rank's traceback buries the one that matters,
so a rank whose failure is only a consequence of another's stays silent; every rank's traceback goes to
``output_dir/.shardtune/rank-<N>-error.txt``.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from shardtune import run_files
from shardtune.errors import write_stderr_line

ERROR_FILE = run_files.RANK_ERROR
# The launching host recognises (and de-duplicates) reports by this prefix.
REPORT_PREFIX = "[shardtune] rank "

# What a collective raises when a peer process went away (gloo, NCCL, the c10d store). NCCL's own texts:
# ncclGetErrorString(ncclRemoteError), its socket transport, and ProcessGroupNCCL after an abort.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "communicator was aborted", "connection closed by remote peer", "ncclremoteerror")
# What a collective raises when a peer did not arrive within the process group timeout (ddp_timeout); under NCCL
# ProcessGroupNCCL's watchdog: "Watchdog caught collective operation timeout: WorkNCCL(...) ran for N milliseconds
# before timing out", and its heartbeat monitor when the watchdog itself is stuck.
_TIMED_OUT = ("timed out waiting", "collective operation timeout", "socket timeout", "heartbeat monitor timed out")
# NCCL refuses a communicator with two ranks on one GPU (init.cc): "Duplicate GPU detected : rank 1 and rank 0 both
# on CUDA device 1000".
_DUPLICATE_GPU = "duplicate gpu detected"


class FailureKind(Enum):
    OWN = "own"              # this rank's own error: the one the user needs to see
    PEER_LOST = "peer_lost"  # another rank died first; its own report says why
    TIMED_OUT = "timed_out"  # a collective waited longer than ddp_timeout: another rank is stuck or died


def classify_failure(err: BaseException) -> FailureKind:
    """Tell this rank's own error from the errors that another rank's failure causes in collectives."""
    if not isinstance(err, RuntimeError):  # torch.distributed errors are RuntimeErrors (DistError)
        return FailureKind.OWN
    message = str(err).lower()
    if any(text in message for text in _PEER_LOST):
        return FailureKind.PEER_LOST
    if any(text in message for text in _TIMED_OUT):
        return FailureKind.TIMED_OUT
    return FailureKind.OWN


# The summaries of failures that only follow another rank's: the page and the Ray report list these last.
_CONSEQUENCES = ("lost the connection to another rank", "a collective waited longer than ddp_timeout",
                 "stopped by the launcher after another rank failed")


def is_consequence(summary: str) -> bool:
    """Whether a rank's one-line report only says that another rank failed first."""
    return any(text in summary for text in _CONSEQUENCES)


def error_file(output_dir: Path, rank: int) -> Path:
    return output_dir / ERROR_FILE.format(rank=rank)


def failure_summary(err: BaseException, rank: int, ddp_timeout: int) -> str:
    """The one line a user sees for this rank's failure (also the first line of its error file)."""
    kind = classify_failure(err)
    if kind is FailureKind.TIMED_OUT:
        what = (f"a collective waited longer than ddp_timeout ({ddp_timeout} s): another rank is stuck or died; "
                "raise ddp_timeout if a step legitimately takes that long")
    elif kind is FailureKind.PEER_LOST:
        what = "lost the connection to another rank, which failed or was killed first"
    elif _DUPLICATE_GPU in str(err).lower():
        what = ("two ranks are on one GPU (NCCL: Duplicate GPU detected): start one process per GPU (NPROC_PER_NODE, "
                "CUDA_VISIBLE_DEVICES, Ray's resources_per_worker GPU: 1)")
    else:
        what = f"{type(err).__name__}: {_first_line(err)}"
    return f"{REPORT_PREFIX}{rank} failed: {what}"


def save_rank_failure(err: BaseException, rank: int, output_dir: Path, ddp_timeout: int) -> str:
    """Write the rank's error file (summary line, then the traceback); return the line to show for it.

    Written before anything is printed: a peer that sees this file stops at once instead of waiting to save.
    """
    summary = failure_summary(err, rank, ddp_timeout)
    details = "".join(traceback.format_exception(err))
    path = error_file(output_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, f"{summary}\n\n{details}")
    except OSError:
        return f"{summary}\n{details}"
    return f"{summary} (full traceback: {path})"


def report_rank_failure(err: BaseException, rank: int, output_dir: Path, ddp_timeout: int) -> int:
    """Save the traceback, print one line unless the failure only echoes another rank's; exit code 1."""
    shown = save_rank_failure(err, rank, output_dir, ddp_timeout)
    # Progress bars held by the failed frames close now, so their last redraw comes before the report.
    traceback.clear_frames(err.__traceback__)
    if classify_failure(err) is not FailureKind.PEER_LOST:
        write_stderr_line(shown)
    return 1


def save_stopped_after_peer(rank: int, output_dir: Path, since: float) -> None:
    """Record that the launcher stopped this rank because another rank failed, unless this rank already wrote its
    own report: without it a rank stopped before its next collective noticed the lost peer leaves no trace."""
    path = error_file(output_dir, rank)
    with contextlib.suppress(OSError):
        if path.is_file() and path.stat().st_mtime >= since:
            return
        write_whole(path, f"{REPORT_PREFIX}{rank} failed: stopped by the launcher after another rank failed\n\n"
                          "This rank was stopped by a signal (torchrun stops every rank once one fails); the "
                          "failing rank's own error file says why.\n")


def write_whole(path: Path, text: str) -> None:
    """``path`` appears with all of ``text`` or not at all: the web page and the peers poll these files, and a file
    read between its creation and its write (or left by a rank killed mid-write) would be a report without a line.
    The partial file's name starts with a dot, so no ``rank-*-error.txt`` pattern sees it."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def peer_failed_since(output_dir: Path, since: float) -> bool:
    """Whether any rank wrote an error file after ``since`` (a time.time() value): this run is failing."""
    for path in (output_dir / ERROR_FILE).parent.glob("rank-*-error.txt"):
        try:
            if path.stat().st_mtime >= since:
                return True
        except OSError:
            continue
    return False


def saved_failure_report(output_dir: Path, rank: int, since: float) -> str | None:
    """The one-line report in a rank's error file written after ``since`` (None when there is none)."""
    path = error_file(output_dir, rank)
    try:
        if path.stat().st_mtime < since:
            return None
        summary = path.read_text().split("\n", 1)[0]
    except OSError:
        return None
    return f"{summary} (full traceback: {path})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


# ---- NCCL's watchdog: a rank it ends never raises in Python ----

_RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")  # torchrun's prefix on each line of a rank's output
_PG_RANK = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d+)\]")  # ProcessGroupNCCL's own log prefix
_WORK = re.compile(r"WorkNCCL\(SeqNum=(\d+), OpType=(\w+).*?Timeout\(ms\)=(\d+)\)")
_WATCHDOG_ENDS = ("watchdog thread terminated with exception", "taking the entire process down",
                  "heartbeat monitor timed out", "watchdog caught collective operation timeout")


@dataclass(frozen=True)
class WatchdogReport:
    """What ProcessGroupNCCL's watchdog logged before it ended a rank (SIGABRT, no Python exception)."""

    rank: int
    kind: FailureKind  # TIMED_OUT or PEER_LOST; OWN when it logged no recognised reason
    detail: str = ""

    def line(self) -> str:
        """The one-line report, as a rank that could raise would have printed it."""
        if self.kind is FailureKind.TIMED_OUT:
            what = (f"{self.detail or 'a collective'} waited longer than the process group timeout (ddp_timeout): "
                    "another rank is stuck or died; raise ddp_timeout if a step legitimately takes that long")
        elif self.kind is FailureKind.PEER_LOST:
            what = ("it lost the connection to another rank, which failed or was killed first (or the network "
                    "between the nodes failed)")
        else:
            what = "an NCCL operation failed (its log above says which)"
        return f"{REPORT_PREFIX}{self.rank} failed: NCCL's watchdog ended the process: {what}"


def read_watchdog_line(line: str) -> WatchdogReport | None:
    """The report in one line of a rank's stderr, when it is ProcessGroupNCCL's watchdog ending the rank."""
    lowered = line.lower()
    if not any(text in lowered for text in _WATCHDOG_ENDS):
        return None
    found = _RANK_PREFIX.search(line) or _PG_RANK.search(line)
    if found is None:
        return None
    rank = int(found.group(1))
    work = _WORK.search(line)
    if "heartbeat monitor timed out" in lowered:
        return WatchdogReport(rank, FailureKind.TIMED_OUT, "NCCL's watchdog itself (a CUDA or NCCL call hung)")
    if any(text in lowered for text in _TIMED_OUT) and work is not None:
        seconds = int(work.group(3)) // 1000
        return WatchdogReport(rank, FailureKind.TIMED_OUT,
                              f"collective {work.group(2)} (#{work.group(1)}, timeout {seconds} s)")
    if any(text in lowered for text in _PEER_LOST):
        return WatchdogReport(rank, FailureKind.PEER_LOST)
    return WatchdogReport(rank, FailureKind.OWN)


def strongest(reports: list[WatchdogReport]) -> list[WatchdogReport]:
    """One report per rank: the one that says the most (a timeout or a lost peer over the generic teardown)."""
    best: dict[int, WatchdogReport] = {}
    for report in reports:
        if report.rank not in best or best[report.rank].kind is FailureKind.OWN:
            best[report.rank] = report
    return list(best.values())
