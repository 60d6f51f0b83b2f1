"""Writing one rank's checkpoint files: at once (``async_save: false``), or staged into host memory and written by a
background thread while training goes on (``async_save: true``).

Every file is flushed and fsynced before its write counts as done, so the ``COMPLETE`` marker written after every
rank's writes (train/checkpoint.py) never vouches for data still in a page cache. Staging copies each tensor (to
pinned host memory from an accelerator), so the files hold the weights of the step that was saved even while the
next steps change the live ones. One thread writes the files of one checkpoint after another: a second save waits
for the first (``wait``), so at most one checkpoint per rank is held in host memory.

``SHARDTUNE_TEST_KILL_AT`` (tests only, tests/e2e/test_checkpoint_kills.py) names a point of the save at which this
process kills itself with SIGKILL, to prove that no instant of a save can leave a checkpoint that resume picks
but cannot read; ``SHARDTUNE_TEST_PAUSE_AT`` holds a save there, for a signal to arrive in the middle of it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KILL_AT_VARIABLE = "SHARDTUNE_TEST_KILL_AT"
PAUSE_AT_VARIABLE = "SHARDTUNE_TEST_PAUSE_AT"
PAUSE_SECONDS = 5.0
_point_counts: dict[str, int] = {}
_count_lock = threading.Lock()


def fault_point(name: str) -> None:
    """What the test harness asked for at ``name`` (nothing otherwise): ``SHARDTUNE_TEST_KILL_AT`` dies here by
    SIGKILL, ``SHARDTUNE_TEST_PAUSE_AT`` sleeps (a save made long enough to signal the run in the middle of it).
    Either names ``name[#n][@rank]``: its n-th visit (counted from 1 in this process), on that rank only."""
    kill, pause = os.environ.get(KILL_AT_VARIABLE), os.environ.get(PAUSE_AT_VARIABLE)
    if not kill and not pause:
        return
    with _count_lock:
        _point_counts[name] = _point_counts.get(name, 0) + 1
        visit = _point_counts[name]
    if kill and _names(kill, name, visit):
        os.kill(os.getpid(), signal.SIGKILL)
    if pause and _names(pause, name, visit):
        time.sleep(PAUSE_SECONDS)


def _harness_active() -> bool:
    return bool(os.environ.get(KILL_AT_VARIABLE) or os.environ.get(PAUSE_AT_VARIABLE))


def _names(wanted: str, name: str, visit: int) -> bool:
    wanted, _, rank = wanted.partition("@")
    point, _, nth = wanted.partition("#")
    return point == name and visit == int(nth or 1) and (not rank or os.environ.get("RANK", "0") == rank)


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the storage device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Every file and folder below ``folder``, then ``folder`` itself (files written by libraries that do not
    fsync: DeepSpeed's, torch's distributed checkpoint metadata)."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def write_durably(path: Path, text: str) -> None:
    """A small file written, flushed and fsynced, then its folder's entry."""
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_path(path.parent)


class _FaultingFile:
    """A file whose first write is a fault point: the harness can kill the rank in the middle of a file (some bytes
    written, the file incomplete)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.visited = False

    def write(self, data: Any) -> int:
        written = self.handle.write(data)
        if not self.visited and self.handle.tell() > 0:
            self.visited = True
            self.handle.flush()
            fault_point("write-file")
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


def save_torch_file(obj: Any, path: Path) -> None:
    """``torch.save`` flushed and fsynced."""
    with open(path, "wb") as raw:
        handle = _FaultingFile(raw) if _harness_active() else raw
        torch.save(obj, handle)
        raw.flush()
        os.fsync(raw.fileno())


def save_safetensors_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file flushed and fsynced."""
    from safetensors.torch import save

    data = save({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()})
    with open(path, "wb") as raw:
        handle = _FaultingFile(raw) if _harness_active() else raw
        handle.write(data)
        raw.flush()
        os.fsync(raw.fileno())


def staged(obj: Any, pin: bool, reuse: list[torch.Tensor] | None = None,
           made: list[torch.Tensor] | None = None) -> Any:
    """``obj`` with every tensor copied into host memory of its own (pinned when ``pin``); containers rebuilt, other
    values shared (they are configuration, not state the next step changes). ``reuse``: host tensors of an earlier
    staging of the same state, filled again where shape and dtype match (no allocation, no page faults); ``made``
    receives every host tensor used, in order."""
    made = [] if made is None else made
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        index = len(made)
        host = reuse[index] if reuse is not None and index < len(reuse) else None
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin and tensor.device.type != "cpu")
        host.copy_(tensor, non_blocking=pin and tensor.device.type != "cpu")
        made.append(host)
        return host
    if isinstance(obj, dict):
        entries = {key: staged(value, pin, reuse, made) for key, value in obj.items()}
        return collections.OrderedDict(entries) if isinstance(obj, collections.OrderedDict) else entries
    if isinstance(obj, list):
        return [staged(value, pin, reuse, made) for value in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(staged(value, pin, reuse, made) for value in obj)
    return obj


class HostStaging:
    """Host copies kept from one save to the next, one set per file name: a run's checkpoint has the same tensors
    every time, so from the second save on staging is a copy into memory already mapped (the first save also pays
    for allocating it). Held for the whole run: the one checkpoint per rank that async_save costs in host memory."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.slots: dict[str, list[torch.Tensor]] = {}

    def stage(self, slot: str, obj: Any) -> Any:
        made: list[torch.Tensor] = []
        copy = staged(obj, self.pin, self.slots.get(slot), made)
        self.slots[slot] = made
        return copy


def _lower_priority() -> None:
    """The writer thread yields the cores to the training step: a checkpoint waits, a step holds every rank."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # Linux: a thread's own nice value


@dataclass
class SaveTimes:
    """What one save cost this rank: seconds the training was held, and seconds the files took to write."""

    blocked: float = 0.0
    written: float = 0.0


class CheckpointWriter:
    """One rank's checkpoint writes; ``background``: staged copies written by one thread, in order."""

    def __init__(self, background: bool, pin: bool = False) -> None:
        self.background = background
        self.pin = pin
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, "shardtune-checkpoint", initializer=_lower_priority) if background else None
        self._staging = HostStaging(pin)
        self._held: list[Callable[[], None]] | None = None
        self._pending: list[concurrent.futures.Future] = []
        self._first_submit: float | None = None
        self._last_done: float | None = None
        self._lock = threading.Lock()

    def save_torch(self, obj: Any, path: Path) -> None:
        if self._pool is None:
            save_torch_file(obj, path)
            return
        copy = self._staging.stage(path.name, obj)  # the previous save's writes have ended (CheckpointSaver.save)
        self._synchronize_copies()
        self.submit(lambda: save_torch_file(copy, path))

    def save_safetensors(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        if self._pool is None:
            save_safetensors_file(tensors, path)
            return
        copy = self._staging.stage(path.name, tensors)
        self._synchronize_copies()
        self.submit(lambda: save_safetensors_file(copy, path))

    def submit(self, write: Callable[[], None]) -> None:
        """Run ``write`` after the writes before it (at once when not in the background; inside ``staging``, once
        the staging ends)."""
        if self._pool is None:
            write()
            return
        if self._held is not None:
            self._held.append(write)
            return
        if self._first_submit is None:
            self._first_submit = time.perf_counter()
        future = self._pool.submit(self._timed, write)
        self._pending.append(future)

    @contextlib.contextmanager
    def staging(self) -> Iterator[None]:
        """Stage a whole checkpoint before the thread writes any of it: the thread's serialising would compete for
        the cores and memory bandwidth the copies need, and the copies are the time training is held."""
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            for write in held:
                self.submit(write)

    def follow(self, future: Any) -> None:
        """A write another library runs in the background (torch's ``dcp.async_save``): waited for like ours."""
        if self._first_submit is None:
            self._first_submit = time.perf_counter()
        self._pending.append(future)
        future.add_done_callback(lambda _f: self._mark_done())

    def _timed(self, write: Callable[[], None]) -> None:
        write()
        self._mark_done()

    def _mark_done(self) -> None:
        with self._lock:
            self._last_done = time.perf_counter()

    def _synchronize_copies(self) -> None:
        # Pinned copies from an accelerator are asynchronous: the live tensors may change once this returns.
        if self.pin and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def finished(self) -> bool:
        """Whether every write submitted so far has ended (well or not)."""
        return all(f.done() for f in self._pending)

    def failure(self) -> BaseException | None:
        """The first error of a finished write, if any."""
        for future in self._pending:
            if future.done() and future.exception() is not None:
                return future.exception()
        return None

    def wait(self) -> float:
        """Block until every write has ended; re-raise the first one's error. Returns the seconds the writes took
        (first submitted to last done)."""
        started = self._first_submit
        try:
            for future in self._pending:
                future.result()
        finally:
            self._pending = []
            self._first_submit = None
        ended = self._last_done or time.perf_counter()
        return 0.0 if started is None else max(0.0, ended - started)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
