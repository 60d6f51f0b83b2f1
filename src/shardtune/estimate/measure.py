"""Measured peak memory of this rank, to record beside the estimate after a run.

On a GPU: ``torch.cuda.max_memory_allocated`` (tensors only, like the estimate's measurable part). On the CPU:
the process's peak resident memory. RSS also holds the interpreter and its libraries, so call
``mark_memory_baseline`` just before the model is loaded and pass its result: the peak is then measured from
that point (Linux resets the high-water mark through /proc/self/clear_refs) and the baseline is subtracted.
"""

from __future__ import annotations

import contextlib
import importlib
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
# Libraries every rank of a process group loads before its first step, put under every rank's baseline. Ranks
# other than 0 import datasets before the mark (launch/worker.py, quiet_this_rank, turns its progress bars off),
# rank 0 only when it reads the data, after it: rank 0, whose peak is the one compared with the estimate, then
# counted about 100 MiB of modules (datasets, pandas, pyarrow, huggingface_hub) that the other ranks did not
# (ZeRO-3 LoRA on the tiny model, 2 CPU ranks: 341 vs 233 MiB gained; docs/estimate.md, "Measured: ZeRO-3 LoRA").
# A one-process run has no other rank to match, and its recorded runtime (compare.py) counts them.
_LOADED_BEFORE_BASELINE = ("datasets",)


@dataclass(frozen=True)
class MemoryBaseline:
    rss_bytes: int  # resident memory when marked (0 on a GPU)
    peak_was_reset: bool  # the high-water mark restarted from rss_bytes


def _cuda_in_use() -> bool:
    # Never import torch here: a process that has not imported it is not using a GPU through it.
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def _status_bytes(field: str) -> int | None:
    if not _STATUS.is_file():
        return None
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def mark_memory_baseline() -> MemoryBaseline:
    """Start measuring here: reset the peak counters and remember the current resident memory."""
    if _cuda_in_use():
        sys.modules["torch"].cuda.reset_peak_memory_stats()
        return MemoryBaseline(0, True)
    _load_run_libraries()
    try:
        _CLEAR_REFS.write_text("5")  # Linux: VmHWM := VmRSS
        reset = True
    except OSError:
        reset = False
    return MemoryBaseline(_status_bytes("VmRSS") or _ru_maxrss_bytes(), reset)


def _load_run_libraries() -> None:
    torch = sys.modules.get("torch")  # never imported here: without it there is no process group either
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    for name in _LOADED_BEFORE_BASELINE:
        with contextlib.suppress(ImportError):  # a run without them imports them after the mark on no rank either
            importlib.import_module(name)


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB


def measured_peak_memory_bytes(baseline: MemoryBaseline | None = None) -> int:
    """Peak accelerator memory allocated (GPU) or peak resident memory (CPU), minus ``baseline`` if given."""
    if _cuda_in_use():
        return int(sys.modules["torch"].cuda.max_memory_allocated())
    peak = _status_bytes("VmHWM") or _ru_maxrss_bytes()
    if baseline is None:
        return peak
    # Without a reset the high-water mark may predate the baseline; the difference is then a lower bound.
    return max(0, peak - baseline.rss_bytes)


def host_peak_bytes() -> int:
    """Peak resident host memory of this process (on a GPU too, where the other measures count device memory)."""
    return _status_bytes("VmHWM") or _ru_maxrss_bytes()
