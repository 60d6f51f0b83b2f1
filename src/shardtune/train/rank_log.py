"""Every rank's own step log, ``ranks/rank_<R>.jsonl`` in the run folder: what `shardtune status` and
`shardtune web` read to show each rank while it runs.

One JSON line per optimizer step (written and flushed at once, so a reader on the same file system sees it), plus
a ``start`` line (host, process id, the memory estimate), ``save`` / ``eval`` lines and an ``end`` line. The time
of the last line is the rank's heartbeat. A record costs a few tens of microseconds (benchmarks/rank_log_overhead.py):
no collective, no device synchronisation, one read of /proc/self/statm.

``wait_s`` is the time the rank spent blocked in the loop's own per-step reductions (the token count before the
forward pass, the stop flag after the step): the time it waited for slower ranks there. A rank that is slow
between steps (data loading, a paused process, a slow disk) makes the others wait there, so its ``step_s - wait_s``
stands out; slowness inside the engine's own gradient communication is shared by every rank's step time.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

from shardtune import run_files

_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rank_log_path(output_dir: Path, rank: int) -> Path:
    return output_dir / run_files.RANK_LOG.format(rank=rank)


def resident_bytes() -> int | None:
    """This process's resident host memory (one small read of /proc; None where there is no /proc)."""
    try:
        return int(_STATM.read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def device_memory(device: Any) -> dict[str, int]:
    """Allocated, reserved and peak accelerator memory of this rank's device (empty on the CPU)."""
    if getattr(device, "type", "cpu") != "cuda":
        return {}
    import torch

    return {"mem_allocated": int(torch.cuda.memory_allocated(device)),
            "mem_reserved": int(torch.cuda.memory_reserved(device)),
            "mem_peak": int(torch.cuda.max_memory_allocated(device))}


class RankLog:
    """Appends this rank's records to its own file; every write is one line, flushed."""

    def __init__(self, path: Path, rank: int, device: Any = None) -> None:
        self.path = path
        self.rank = rank
        self.device = device
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the run
        self._last = time.perf_counter()

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({"time": round(time.time(), 3), **record}, separators=(",", ":")) + "\n")
        self._file.flush()

    def start(self, *, world_size: int, total_steps: int, start_step: int, estimate_peak_bytes: float | None,
              baseline_rss_bytes: int | None = None) -> None:
        self._last = time.perf_counter()
        self.write({"event": "start", "rank": self.rank, "world_size": world_size, "host": socket.gethostname(),
                    "pid": os.getpid(), "ppid": os.getppid(), "device": str(self.device or "cpu"),
                    "total_steps": total_steps, "step": start_step,
                    "estimate_peak_bytes": None if estimate_peak_bytes is None else int(estimate_peak_bytes),
                    "baseline_rss": baseline_rss_bytes})

    def restart_clock(self) -> None:
        """Time after this (a checkpoint save, an evaluation) is not the next step's."""
        self._last = time.perf_counter()

    def step(self, step: int, metrics: dict[str, float], wait_seconds: float) -> None:
        now = time.perf_counter()
        step_s, self._last = now - self._last, now
        record: dict[str, Any] = {"event": "step", "step": step, "step_s": round(step_s, 5),
                                  "data_s": round(metrics.get("data_seconds", 0.0), 5),
                                  "wait_s": round(wait_seconds + metrics.get("sync_seconds", 0.0), 5),
                                  "loss": round(metrics["loss"], 6) if "loss" in metrics else None}
        local = metrics.get("local_tokens")
        if local is not None:
            record["tokens"] = int(local)
            record["tokens_per_s"] = round(local / step_s, 1) if step_s > 0 else None
        record["rss"] = resident_bytes()
        record.update(device_memory(self.device))
        self.write(record)

    def event(self, name: str, step: int, **fields: Any) -> None:
        self.write({"event": name, "step": step, **fields})

    def close(self, step: int, interrupted: bool) -> None:
        if self._file is None:
            return
        self.write({"event": "end", "step": step, "interrupted": interrupted})
        self._file.close()
        self._file = None
