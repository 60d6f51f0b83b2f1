"""The machines a run is estimated for, and memory sizes as users write them (80GiB, 24GB, 512G)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardtune.errors import ConfigError

MiB = 1024**2
GiB = 1024**3
# Decimal and binary units; a bare K/M/G/T means binary, as `free -g` and most GPU spec sheets do.
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": GiB, "gb": 1000**3, "gib": GiB,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, flag: str) -> int:
    """Bytes from '80GiB', '24GB', '512G', '1.5TiB' or a plain byte count; errors name ``flag``."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"{flag} ({text}): not a memory size; write it like 80GiB, 24GB or 512G")
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise ConfigError(f"{flag} ({text}): must be more than zero bytes")
    return int(value)


def format_size(num_bytes: float) -> str:
    """Human-readable binary size with three significant digits (e.g. '31.4 GiB')."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Hardware:
    """``gpu_memory`` None means the ranks run on the CPU and their device memory is the node's RAM."""

    nodes: int = 1
    gpus_per_node: int = 1
    gpu_memory: int | None = None
    cpu_memory: int = 0

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def on_gpu(self) -> bool:
        return self.gpu_memory is not None

    def describe(self) -> str:
        device = f"{self.gpus_per_node} x {format_size(self.gpu_memory)} GPU" if self.gpu_memory else \
            f"{self.gpus_per_node} CPU ranks"
        nodes = f"{self.nodes} nodes x " if self.nodes > 1 else ""
        return f"{nodes}{device} per node, {format_size(self.cpu_memory)} CPU memory per node"
