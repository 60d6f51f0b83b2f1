"""What a finished run measured beside the estimate of that same quantity (train_results.json, the run-end line).

The measurement (``measure.py``) is a rank's peak since a baseline taken after the process group is up and
before the tokenizer, the data and the model: on a GPU the tensors the caching allocator handed out, on the CPU
the resident memory gained. Both include the set-up (loading and sharding the model) as well as the steps, and
on the CPU also what the run's libraries and data take after the baseline. So the comparable estimate is
``max(training, setup) + runtime``, not the model states + activations alone. README.md has the numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from shardtune.estimate.hardware import MiB
from shardtune.estimate.parts import Components, Setup

# Resident memory a CPU rank gains after the baseline besides its tensors, by EnginePlan.kind: the modules the
# run imports after it (tokenizer and model code, peft; DeepSpeed also starts its communication op inside
# deepspeed.initialize), the tokenizer and the tokenised data, pages of libraries touched for the first time.
# FSDP imports the most before the baseline (DTensor and fully_shard), so less follows it. Measured with the
# tiny model (0.37M parameters: its tensors are about 40 MiB, mostly activations) on 2 CPU ranks, full and LoRA,
# fp32: measured peak of the busiest rank minus the estimate of its tensors (README.md, "A finished run's memory
# line"), 2026-11-29 for the ranks of a process group, since every rank's baseline holds the data libraries
# (measure.py).
CPU_RUN_RUNTIME_BYTES = {
    # One process: 156 and 162 MiB (2026-11-23; its baseline did not change). Measured again on 2026-11-30: 197 to
    # 214 MiB; left, since the recorded one-process runs (tests/unit/test_estimate_vision.py, 2026-11-27, with
    # benchmarks/memory.py's allocator settings) agree with it (docs/estimate.md, "Measured: ZeRO-3 LoRA").
    "local": 159 * MiB,
    "ddp": 112 * MiB,  # 111 and 113 MiB
    "fsdp": 96 * MiB,  # 93 and 98 MiB
    "deepspeed": 211 * MiB,  # ZeRO-2 218 and 222, ZeRO-3 198 and 207 MiB
}
# What a CPU rank computing in bf16 or fp16 holds beyond the same run in fp32: oneDNN's compiled kernels and the
# two caches that keep them, bounded to 64 entries each in every rank (cpu_kernel_caches.py; fp32 matmuls run
# through MKL and keep none). The same tiny-model runs, 8 steps, bf16 runtime minus fp32 runtime, full and LoRA
# (benchmarks/cpu_runtime_memory.py, results/cpu-runtime-memory.md, 2026-11-30).
CPU_HALF_PRECISION_KERNEL_BYTES = {
    "local": 60 * MiB,  # 60 and 60 MiB
    "ddp": 59 * MiB,  # 62 and 56 MiB
    "fsdp": 38 * MiB,  # 37 and 39 MiB
    "deepspeed": 43 * MiB,  # ZeRO-3 40 and 46 MiB
}


@dataclass(frozen=True)
class RunMemoryEstimate:
    """The estimate of what a run measures on its busiest rank, in bytes."""

    training: float  # tensors of a step: model states, buffers, activations
    setup: float  # while the model is loaded and sharded (on the CPU: this rank's host memory then)
    runtime: float  # besides tensors, what the measurement counts (CPU runs; 0 on a GPU)
    kernels: float = 0.0  # CPU half-precision kernels, from the first step on

    @property
    def peak(self) -> float:
        return max(self.training + self.kernels, self.setup) + self.runtime

    @property
    def setup_peak(self) -> float:
        return self.setup + self.runtime


def run_memory_estimate(device: Components, setup: Setup, on_gpu: bool, engine_kind: str,
                        half_precision: bool = False) -> RunMemoryEstimate:
    """The comparable estimate from an option's memory: on the CPU the device is host memory (a rank that maps
    the whole checkpoint counts its pages too), and the runtime adds to both phases."""
    if on_gpu:
        return RunMemoryEstimate(device.measurable, setup.device, 0.0)
    host = setup.host_peak_per_rank
    runtime = CPU_RUN_RUNTIME_BYTES.get(engine_kind, max(CPU_RUN_RUNTIME_BYTES.values()))
    kernels = 0.0
    if half_precision:
        kernels = CPU_HALF_PRECISION_KERNEL_BYTES.get(engine_kind, max(CPU_HALF_PRECISION_KERNEL_BYTES.values()))
    return RunMemoryEstimate(device.measurable, host, runtime, kernels)


def compare_run_memory(estimate: RunMemoryEstimate | None, peak_per_rank: list[int],
                       setup_peak_per_rank: list[int] | None = None) -> tuple[dict[str, Any], str | None]:
    """Fields for train_results.json and the line to print: the largest measured peak per rank against the
    estimate of the same thing (None: no estimate, e.g. an unknown model shape; then no line either)."""
    if estimate is None or not peak_per_rank:
        return {"estimated_memory_bytes": None}, None
    found: dict[str, Any] = {
        "estimated_memory_bytes": int(round(estimate.peak)),
        "estimated_memory_parts_bytes": {k: int(round(v)) for k, v in asdict(estimate).items()},
        "memory_measured_over_estimate": _ratio(max(peak_per_rank), estimate.peak),
    }
    line = (f"[shardtune] peak memory {_mib(max(peak_per_rank))} per rank (measured) vs {_mib(estimate.peak)} "
            f"(estimated: tensors {_mib(estimate.training)}, set-up {_mib(estimate.setup)}"
            + (f", runtime {_mib(estimate.runtime)}" if estimate.runtime else "")
            + (f", half-precision CPU kernels {_mib(estimate.kernels)}" if estimate.kernels else "")
            + f"): ratio {found['memory_measured_over_estimate']}")
    if setup_peak_per_rank:
        found["estimated_setup_memory_bytes"] = int(round(estimate.setup_peak))
        found["setup_memory_measured_over_estimate"] = _ratio(max(setup_peak_per_rank), estimate.setup_peak)
        line += (f"; set-up peak {_mib(max(setup_peak_per_rank))} vs {_mib(estimate.setup_peak)}: ratio "
                 f"{found['setup_memory_measured_over_estimate']}")
    return found, line


def _ratio(measured: float, estimated: float) -> float | None:
    return round(measured / estimated, 3) if estimated > 0 else None


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MiB:.1f} MiB"
