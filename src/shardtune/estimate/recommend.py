"""Pick the fastest option that fits and say why."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.estimate.hardware import Hardware, format_size
from shardtune.estimate.parts import Option
from shardtune.estimate.workload import Workload


@dataclass(frozen=True)
class Recommendation:
    option: Option | None
    reason: str


def recommend(options: list[Option], hardware: Hardware, workload: Workload | None = None) -> Recommendation:
    """The fastest available option that fits; ties (ZeRO-3 vs FULL_SHARD) go to the smaller device peak.
    With the workload, the remedies when nothing fits leave out what it already does."""
    fitting = [o for o in options if o.fits]
    if not fitting:
        return Recommendation(None, nothing_fits_reason(options, hardware, workload))
    best = min(fitting, key=lambda o: (o.speed_rank, o.device_peak))
    return Recommendation(best, fit_reason(best, options, hardware))


def fit_reason(best: Option, options: list[Option], hardware: Hardware) -> str:
    """'ZeRO-2: fits in 38.1 GiB of 80 GiB per GPU; faster options need more: DDP 96 GiB, ZeRO-1 52 GiB.'"""
    where = f"{format_size(best.device_peak)} of {format_size(hardware.gpu_memory)} per GPU" \
        if hardware.gpu_memory is not None \
        else f"{format_size(best.cpu_per_node)} of {format_size(hardware.cpu_memory)} CPU memory"
    faster = [o for o in options if o.speed_rank < best.speed_rank and o.available and not o.fits]
    text = f"{best.name} is the fastest option that fits ({where})"
    if faster:
        text += "; the faster ones do not: " + ", ".join(f"{o.name} {_shortfall(o, hardware)}" for o in faster)
    elif best.speed_rank == 0:
        text += ": no sharding or offload is needed"
    return text


def _shortfall(option: Option, hardware: Hardware) -> str:
    if hardware.on_gpu and option.device_peak > (hardware.gpu_memory or 0):
        return f"needs {format_size(option.device_peak)}"
    return f"needs {format_size(option.cpu_per_node)} CPU memory per node"


def nothing_fits_reason(options: list[Option], hardware: Hardware, workload: Workload | None = None) -> str:
    available = [o for o in options if o.available]
    if not available:
        return "no engine option can run this job here"
    smallest = min(available, key=lambda o: o.device_peak if hardware.on_gpu else o.cpu_per_node)
    return (f"no option fits {hardware.describe()}; the smallest, {smallest.name}, needs "
            f"{format_size(smallest.device_peak)} per device and {format_size(smallest.cpu_per_node)} CPU memory "
            f"per node: {', '.join(remedies(workload))}")


def remedies(workload: Workload | None) -> list[str]:
    """What would lower the memory, without what the job already does."""
    items = []
    if workload is None or not workload.gradient_checkpointing:
        items.append("enable gradient_checkpointing")
    items.append("lower per_device_train_batch_size or cutoff_len")
    if workload is None or not workload.is_adapter:
        items.append("use LoRA")
    items.append("or add GPUs")
    if workload is not None and workload.gradient_checkpointing:
        items[-1] += " (gradient_checkpointing is on already)"
    return items


def checkpointing_note(options: list[Option], with_checkpointing: list[Option]) -> str | None:
    """The options that do not fit as configured but fit with activation checkpointing (the same options computed
    with ``gradient_checkpointing`` on), said as the remedy; None when checkpointing rescues none."""
    rescued = [(o, c) for o, c in zip(options, with_checkpointing, strict=True) if o.available and not o.fits
               and c.fits]
    if not rescued:
        return None
    listed = ", ".join(f"{c.name} ({format_size(c.device_peak)} per device)" for _, c in rescued)
    return f"with gradient_checkpointing: true these fit too: {listed}"
