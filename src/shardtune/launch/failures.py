"""What a rank does when training fails: one line for the user, the full traceback in a file.

A failing rank takes its peers down with it: their next collective sees the connection close (or, when the
rank hangs instead, waits until ``ddp_timeout``). Printing every rank's traceback buries the one that matters,
so a rank whose failure is only a consequence of another's stays silent; every rank's traceback goes to
``output_dir/.shardtune/rank-<N>-error.txt``.
"""

from __future__ import annotations

import traceback
from enum import Enum
from pathlib import Path

from shardtune import run_files
from shardtune.errors import write_stderr_line

ERROR_FILE = run_files.RANK_ERROR
# The launching host recognises (and de-duplicates) reports by this prefix.
REPORT_PREFIX = "[shardtune] rank "

# What a collective raises when a peer process went away (gloo, NCCL, the c10d store).
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "communicator was aborted")
# What a collective raises when a peer did not arrive within the process group timeout (ddp_timeout).
_TIMED_OUT = ("timed out waiting", "collective operation timeout", "socket timeout")


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
        path.write_text(f"{summary}\n\n{details}")
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
