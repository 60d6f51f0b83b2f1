"""Throughput bookkeeping: what ``train_results.json`` reports under ``throughput``.

Every optimizer step records its wall time (from the end of the previous step, so data loading
counts), the non-padding tokens it trained and the token slots it computed (both summed over ranks).
The first ``warmup_steps`` steps are left out of the rates: they pay for allocator growth, lazy
initialisation and, on GPU, kernel selection. So are the steps ``profile_steps`` ran under torch.profiler
(train/profile.py), which the profiler slows.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ThroughputMeter:
    warmup_steps: int = 1
    step_seconds: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    slots: list[float] = field(default_factory=list)
    loss_sums: list[float] = field(default_factory=list)
    trainable: list[float] = field(default_factory=list)
    first_step_unix_time: float | None = None
    profiled: set[int] = field(default_factory=set)  # indices of the steps run under the profiler
    _last: float = field(default_factory=time.perf_counter)

    def start(self) -> None:
        """Called when the loop begins: the first step's time starts here, not at model loading."""
        self._last = time.perf_counter()

    def record(self, metrics: dict[str, float], profiled: bool = False) -> None:
        now = time.perf_counter()
        if profiled:
            self.profiled.add(len(self.step_seconds))
        if self.first_step_unix_time is None:
            self.first_step_unix_time = time.time()
        self.step_seconds.append(now - self._last)
        self._last = now
        self.tokens.append(metrics["tokens"])
        self.slots.append(metrics.get("slots", metrics["tokens"]))
        self.loss_sums.append(metrics["loss"] * metrics["trainable_tokens"])
        self.trainable.append(metrics["trainable_tokens"])

    def summary(self) -> dict[str, Any]:
        # With fewer steps than warm-up plus one, keep at least the last step so the rate exists.
        skip = min(self.warmup_steps, max(len(self.step_seconds) - 1, 0))
        measured = [i for i in range(skip, len(self.step_seconds)) if i not in self.profiled] or \
            list(range(skip, len(self.step_seconds)))
        seconds = sum(self.step_seconds[i] for i in measured)
        measured_tokens = sum(self.tokens[i] for i in measured)
        total_slots = sum(self.slots)
        return {
            "effective_tokens_per_second": round(measured_tokens / seconds, 2) if seconds > 0 else None,
            "padding_fraction": round(1 - sum(self.tokens) / total_slots, 4) if total_slots else None,
            "step_time_median_seconds": round(statistics.median(self.step_seconds[i] for i in measured), 5)
            if measured else None,
            "loss_per_token": sum(self.loss_sums) / sum(self.trainable) if sum(self.trainable) else None,
            "warmup_steps": skip,
            "measured_steps": len(measured),
            "profiled_steps": len(self.profiled),
            "first_step_unix_time": self.first_step_unix_time,
        }
