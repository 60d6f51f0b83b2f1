"""Each rank's row, read from its ``ranks/rank_<R>.jsonl`` (train/rank_log.py), and the rules that flag one.

A straggler is a rank whose own time per step (step time less the time it waited for the others at the loop's
reductions), averaged over its last steps, is more than ``STRAGGLER_RATIO`` x the median of all ranks. A stalled
rank has written nothing for ``STALL_FACTOR`` x the median step time (and at least ``STALL_MIN_SECONDS``) while its
run is not over; while it saves or evaluates the allowance is ``BUSY_PHASE_SECONDS``.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtune.web.beneath import AppendedLines, list_beneath

STRAGGLER_RATIO = 1.3
RECENT_STEPS = 5
STALL_FACTOR = 10.0
STALL_MIN_SECONDS = 30.0
BUSY_PHASE_SECONDS = 600.0
_RANK_LOG = re.compile(r"rank_[0-9]+\.jsonl")
_PHASES = {"saving": "saving a checkpoint", "evaluating": "evaluating"}


@dataclass
class RankLogReader:
    """Reads one rank log as it grows (only the new bytes each time, never through a symbolic link: beneath.py);
    keeps the current attempt's summary."""

    path: Path
    start: dict[str, Any] | None = None
    last: dict[str, Any] | None = None  # the latest record of any kind: the heartbeat
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    peak_rss: int = 0
    peak_device: int = 0
    lines: AppendedLines | None = None

    def refresh(self) -> bool:
        """Read what was appended since the last call; True when there was something."""
        if self.lines is None:  # the run folder is the boundary: ranks/ and the log itself may not be links
            self.lines = AppendedLines(self.path.parent.parent, Path(self.path.parent.name) / self.path.name)
        new, restarted = self.lines.read()
        if restarted:  # rewritten (overwrite_output_dir): nothing of the old file counts
            self.start, self.last, self.peak_rss, self.peak_device = None, None, 0, 0
            self.recent.clear()
        for line in new:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                self._take(record)
        return bool(new)

    def _take(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == "start":  # a new attempt (a resume): its steps only
            self.start, self.peak_rss, self.peak_device = record, 0, 0
            self.recent.clear()
        elif event == "step":
            self.recent.append(record)
            self.peak_rss = max(self.peak_rss, record.get("rss") or 0)
            self.peak_device = max(self.peak_device, record.get("mem_peak") or 0)
        self.last = record

    @property
    def rank(self) -> int:
        if self.start is not None:
            return int(self.start["rank"])
        return int(self.path.stem.rsplit("_", 1)[-1])

    @property
    def step(self) -> int:
        return int(self.last.get("step", 0)) if self.last else 0

    @property
    def ended(self) -> bool:
        return bool(self.last and self.last.get("event") == "end")

    def own_seconds(self) -> float | None:
        """Mean over the recent steps of step time less waiting for other ranks. The mean, not the median: a rank
        whose data loader stalls one step in three holds the others back by its whole stall, which a median of the
        recent steps would hide (the web page's straggler test missed such a rank one run in three)."""
        values = [r["step_s"] - r.get("wait_s", 0.0) for r in self.recent if "step_s" in r]
        return statistics.fmean(values) if values else None

    def step_seconds(self) -> float | None:
        values = [r["step_s"] for r in self.recent if "step_s" in r]
        return statistics.median(values) if values else None


def rank_rows(readers: list[RankLogReader], now: float, run_over: bool) -> list[dict[str, Any]]:
    """One row per rank for the table, with the straggler and stall flags set."""
    own = {r.rank: r.own_seconds() for r in readers}
    measured = [v for v in own.values() if v is not None]
    median_own = statistics.median(measured) if measured else None
    steps = [v for r in readers if (v := r.step_seconds()) is not None]
    median_step = statistics.median(steps) if steps else None
    rows = [_row(r, now, own[r.rank], median_own, median_step, run_over) for r in readers]
    return sorted(rows, key=lambda row: row["rank"])


def _row(r: RankLogReader, now: float, own: float | None, median_own: float | None, median_step: float | None,
         run_over: bool) -> dict[str, Any]:
    last_step = r.recent[-1] if r.recent else {}
    start = r.start or {}
    age = now - r.last["time"] if r.last and "time" in r.last else None
    phase = _PHASES.get(r.last.get("event", "")) if r.last else None
    allowance = BUSY_PHASE_SECONDS if phase else max(STALL_MIN_SECONDS, STALL_FACTOR * (median_step or 0.0))
    straggler = own is not None and median_own and own > STRAGGLER_RATIO * median_own
    measured_peak = r.peak_device or (r.peak_rss - (start.get("baseline_rss") or 0) if r.peak_rss else None)
    return {
        "rank": r.rank, "host": start.get("host"), "pid": start.get("pid"), "step": r.step,
        "step_s": last_step.get("step_s"), "own_s": own, "wait_s": last_step.get("wait_s"),
        "data_s": last_step.get("data_s"), "tokens_per_s": last_step.get("tokens_per_s"),
        "loss": last_step.get("loss"), "rss": last_step.get("rss"), "mem_allocated": last_step.get("mem_allocated"),
        "mem_reserved": last_step.get("mem_reserved"), "mem_peak": last_step.get("mem_peak"),
        "measured_peak_bytes": measured_peak, "estimate_peak_bytes": start.get("estimate_peak_bytes"),
        "heartbeat_age": age, "ended": r.ended,
        # A run that is over while this rank wrote no end record: it did not finish what it was doing.
        "phase": "ended" if r.ended else "no end record" if run_over else phase,
        "straggler": bool(straggler) and not r.ended,
        "stalled": bool(age is not None and age > allowance and not r.ended and not run_over),
    }


def read_rank_logs(folder: Path, readers: dict[Path, RankLogReader] | None = None) -> list[RankLogReader]:
    """A reader per ``rank_<R>.jsonl`` in ``folder`` (a run's ``ranks/``), refreshed; ``readers`` keeps them between
    calls. A ``ranks/`` that is a symbolic link is not listed (beneath.py)."""
    readers = {} if readers is None else readers
    names = {name for name in list_beneath(folder.parent, folder.name) if _RANK_LOG.fullmatch(name)}
    for name in names:
        readers.setdefault(folder / name, RankLogReader(folder / name))
    for path in [p for p in readers if p.name not in names]:
        del readers[path]
    for reader in readers.values():
        reader.refresh()
    return sorted(readers.values(), key=lambda r: r.rank)
