"""Facts about this machine that the launching host needs: visible GPUs and their memory, host memory.

A leaf module (standard library only, no torch import, keeps `check` and `estimate` fast): launch and estimate
both ask it, neither asks the other.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def visible_gpu_count(visible: str | None = None, installed: int | None = None) -> int:
    """CUDA devices this process may use, found without importing torch.

    ``visible`` (default: CUDA_VISIBLE_DEVICES) narrows the ``installed`` GPUs (default: what the driver shows);
    on a machine with no GPU a CUDA_VISIBLE_DEVICES left in the environment counts nothing.
    """
    installed = installed_gpu_count() if installed is None else installed
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if installed == 0 or visible is None:
        return installed
    return len(visible_entries(visible, installed))


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as set (None when unset), for messages."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def visible_entries(visible: str, installed: int) -> list[str]:
    """The devices a CUDA_VISIBLE_DEVICES value names, read as CUDA reads it: in order, up to the first entry that
    names no device (``-1``, an index past the installed GPUs, a repeat); GPU-/MIG- UUIDs count as devices."""
    entries: list[str] = []
    for raw in visible.split(","):
        entry = raw.strip()
        is_index = entry.isdigit() and int(entry) < installed
        if not (is_index or entry.startswith(("GPU-", "MIG-"))) or entry in entries:
            break
        entries.append(entry)
    return entries[:installed]


def installed_gpu_count() -> int:
    """NVIDIA GPUs the driver shows on this machine (its /proc entries, else the /dev/nvidiaN device files)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        return len(list(gpus.iterdir()))
    return len([p for p in Path("/dev").glob("nvidia*") if p.name[len("nvidia"):].isdigit()])


def local_gpu_memory() -> int | None:
    """Memory of the first visible GPU from nvidia-smi (None when there is none or it cannot be asked)."""
    if visible_gpu_count() == 0:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.split()[0]) * 1024**2
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def local_cpu_memory() -> int:
    """MemTotal of this machine (Linux), else the physical pages sysconf reports."""
    total = _meminfo_bytes("MemTotal")
    return total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class GpuInfo:
    name: str
    free: int | None  # bytes
    total: int | None


def visible_gpus() -> list[GpuInfo]:
    """Model and free memory of each visible GPU from nvidia-smi (creates no CUDA context); [] when it cannot say."""
    if visible_gpu_count() == 0:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,memory.free,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # indices or UUIDs, in the order the process sees them
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        rows = [r for w in wanted for r in rows if w in (r[0], r[1])]
    return [GpuInfo(r[2], _mib(r[3]), _mib(r[4])) for r in rows if len(r) >= 5]


def _mib(text: str) -> int | None:
    return int(text) * 1024**2 if text.isdigit() else None


def local_available_memory() -> int | None:
    """MemAvailable of this machine (Linux), None elsewhere."""
    return _meminfo_bytes("MemAvailable")


def _meminfo_bytes(field: str) -> int | None:
    """One field of /proc/meminfo in bytes (it counts kB); None where there is no such file or field."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def process_alive(pid: Any, host: Any, started_by: float | None = None) -> bool | None:
    """Whether process ``pid`` runs (None: on another host, or unknown). ``started_by``: a time.time() the process
    had started by; a younger process reuses the pid of one that ended."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or (host and host != socket.gethostname()):
        return None
    try:
        with contextlib.suppress(PermissionError):  # another user's process: alive, and /proc still says more
            os.kill(pid, 0)
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    if fields[0] == "Z":  # ended, not yet reaped
        return False
    return started_by is None or process_start_time(int(fields[19])) <= started_by + 1.0


def process_start_time(ticks_after_boot: int) -> float:
    """A process's start as a time.time() value, from /proc/<pid>/stat's starttime."""
    boot = next((float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                 if line.startswith("btime ")), 0.0)
    return boot + ticks_after_boot / os.sysconf("SC_CLK_TCK")
