"""Where a training step's time goes: torch.profiler over a few optimizer steps (``profile_steps``).

The profiled steps come after the first ``PROFILE_AFTER`` steps of the run (allocator warm-up, lazy
initialisation, compilation). The summary goes into train_results.json under ``profile``: the wall time per step,
the fraction of it the accelerator was busy (the union of its kernels' intervals; None on the CPU), the host
synchronisations per step (reads of a device value into Python, explicit stream/device/event syncs) and the
operators that cost the most CPU time, with their calls per step. It is this rank's view (rank 0's in the file).
"""

from __future__ import annotations

import time
from typing import Any

import torch

PROFILE_AFTER = 2
TOP_OPERATORS = 8
# Host-side events that make the CPU wait for the device: a tensor read into Python (.item(), .tolist(), bool of a
# tensor all become _local_scalar_dense) and the runtime's explicit waits.
SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
               "cudaEventSynchronize", "hipStreamSynchronize", "hipDeviceSynchronize")


class StepProfile:
    """Profiles ``steps`` optimizer steps after the first ``after`` ones the loop runs; ``after_step`` is called
    once per step, ``finish`` at the end of the loop (a run shorter than planned profiles what it ran)."""

    def __init__(self, steps: int, after: int = PROFILE_AFTER) -> None:
        self.steps, self.after = steps, after
        self.seen = 0
        self.profiled = 0
        self.profiler: torch.profiler.profile | None = None
        self.started = 0.0
        self.summary: dict[str, Any] | None = None
        if after == 0:
            self._start()

    def after_step(self) -> None:
        self.seen += 1
        if self.profiler is not None:
            self.profiled += 1
            if self.profiled == self.steps:
                self.finish()
        elif self.summary is None and self.seen == self.after:
            self._start()

    @property
    def active(self) -> bool:
        """Whether the step now running is profiled."""
        return self.profiler is not None

    def finish(self) -> dict[str, Any] | None:
        """Stop profiling if still on; the summary, or None when no step was profiled."""
        if self.profiler is None:
            return self.summary
        _synchronize()
        wall = time.perf_counter() - self.started
        self.profiler.stop()
        self.summary = summarize(self.profiler, max(self.profiled, 1), wall)
        self.profiler = None
        return self.summary

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        _synchronize()
        self.profiler.start()
        self.started = time.perf_counter()


def _synchronize() -> None:
    """The device's queue emptied, so the profiled window holds exactly its own steps' kernels."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summarize(profiler: torch.profiler.profile, steps: int, wall_seconds: float) -> dict[str, Any]:
    averages = profiler.key_averages()
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPERATORS]
    syncs = sum(e.count for e in averages if e.key in SYNC_EVENTS)
    return {
        "steps": steps,
        "wall_ms_per_step": round(1e3 * wall_seconds / steps, 3),
        "device_busy_fraction": device_busy_fraction(profiler, wall_seconds),
        "host_syncs_per_step": round(syncs / steps, 2),
        "top_cpu_operators": [{"name": e.key, "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
                               "calls_per_step": round(e.count / steps, 2)} for e in top],
    }


def device_busy_fraction(profiler: torch.profiler.profile, wall_seconds: float) -> float | None:
    """The union of the accelerator's kernel intervals over the profiled wall time; None without one."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in profiler.events()
                   if e.device_type in (DeviceType.CUDA, DeviceType.PrivateUse1))
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    for span_start, span_end in spans[1:]:
        if span_start > end:  # a gap: close the merged interval
            busy += end - start
            start, end = span_start, span_end
        else:
            end = max(end, span_end)
    busy += end - start
    return round(min(1.0, busy / 1e6 / wall_seconds), 4)


def profile_line(summary: dict[str, Any]) -> str:
    """One line for the run log."""
    busy = summary["device_busy_fraction"]
    top = ", ".join(f"{o['name']} {o['self_cpu_ms_per_step']:.1f} ms" for o in summary["top_cpu_operators"][:3])
    return (f"[shardtune] profile of {summary['steps']} steps: {summary['wall_ms_per_step']:.1f} ms per step, "
            f"device busy {'n/a (no accelerator)' if busy is None else f'{100 * busy:.0f}%'}, "
            f"{summary['host_syncs_per_step']:g} host syncs per step; most CPU time: {top}")
