"""The run lock: one live run per ``output_dir``.

A run holds ``output_dir/.shardtune/run.lock`` from before it writes anything there until it ends: a JSON record of
the holder (host, process id, start time, the job it belongs to) whose modification time is its heartbeat,
refreshed every ``HEARTBEAT_SECONDS`` by a thread of the holding process. The rank logs (``ranks/rank_<R>.jsonl``,
one line per step) count as heartbeats too, so a run whose lock thread starves still reads as alive.

Who holds it: the process that starts the run on node 0 (`shardtune train`, the launcher, for the whole run), or
global rank 0 when the user's own launcher started the ranks (torchrun, accelerate, deepspeed, srun).

A second run into a live run's folder is refused, whatever ``overwrite_output_dir`` says, naming the holder; the
preflight of `train` and `check` says so before anything loads. A lock is stale, and taken over with a warning,
when its holder's process no longer runs on this host, or, held on another host, when neither it nor a rank log
was touched for ``STALE_AFTER_SECONDS`` (a shared filesystem: the holder's host died or lost the mount).

The lock is created whole or not at all (written to a private file, then hard-linked into place, which fails when
a lock is there: atomic on local filesystems and on NFS), so two runs that start together cannot both win. A stale
lock is judged and removed by one process at a time (``_taking_over``), so two runs taking it over cannot both win.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune import run_files
from shardtune.errors import ConfigError
from shardtune.host import process_alive

HEARTBEAT_SECONDS = 10.0
# A holder on another host is taken as gone after this long without a heartbeat: long enough for a shared
# filesystem's attribute caching (NFS caches for up to 60 s) and for modest clock differences between hosts.
STALE_AFTER_SECONDS = 300.0
# A lock created without a hard link (a filesystem that has none) is empty for a moment before its record lands.
BEING_WRITTEN_SECONDS = 5.0


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about the run that holds it."""

    host: str
    pid: int
    started: float
    job: str | None  # the job's identity: the ranks and nodes of one job share it (None: no other process joins)
    heartbeat: float  # the latest of the lock's and the rank logs' modification times

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, since {since}"

    def alive(self, now: float | None = None) -> bool:
        """Whether the holder still runs: asked of the process on this host, judged by the heartbeat elsewhere."""
        if self.pid <= 0:  # a lock that could not be read names no process, unless it is being written now
            return (now if now is not None else time.time()) - self.heartbeat < BEING_WRITTEN_SECONDS
        here = process_alive(self.pid, self.host, self.started)
        if here is not None:
            return here
        return (now if now is not None else time.time()) - self.heartbeat < STALE_AFTER_SECONDS


def lock_path(output_dir: Path) -> Path:
    return output_dir / run_files.RUN_LOCK


def read_holder(output_dir: Path) -> LockHolder | None:
    """The holder the lock names; None when there is no lock. A lock that cannot be read (cut short, edited)
    names nobody alive: its process id 0 matches no process."""
    path = lock_path(output_dir)
    try:
        raw = path.read_text()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    except OSError:
        raw, mtime = "", 0.0
    with contextlib.suppress(ValueError):
        record = json.loads(raw)
        if isinstance(record, dict):
            return LockHolder(host=str(record.get("host", "?")), pid=_int(record.get("pid")),
                              started=_float(record.get("started")), job=record.get("job"),
                              heartbeat=max(mtime, _latest_rank_log(output_dir)))
    return LockHolder(host="?", pid=0, started=mtime, job=None, heartbeat=mtime)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _latest_rank_log(output_dir: Path) -> float:
    latest = 0.0
    for log in (output_dir / run_files.RANK_LOG).parent.glob("rank_*.jsonl"):
        with contextlib.suppress(OSError):
            latest = max(latest, log.stat().st_mtime)
    return latest


def live_run_problems(output_dir: Path, job: str | None = None) -> list[str]:
    """The preflight's word on the lock: a live run of another job holds ``output_dir``."""
    holder = read_holder(output_dir)
    if holder is None or (job is not None and holder.job == job) or not holder.alive():
        return []
    return [live_run_message(output_dir, holder)]


def live_run_message(output_dir: Path, holder: LockHolder) -> str:
    return (f"output_dir: {output_dir} belongs to a live run ({holder.describe()}); see it with `shardtune status "
            f"{output_dir}`, wait for it to end or stop it, or choose another output_dir (overwrite_output_dir "
            "never touches a live run's files)")


def stale_lock_warning(output_dir: Path) -> str | None:
    """What the preflight says of a stale lock this run will take over (None when there is none)."""
    holder = read_holder(output_dir)
    if holder is None or holder.alive():
        return None
    return f"output_dir: {stale_reason(holder)}; this run takes the lock over"


def stale_reason(holder: LockHolder) -> str:
    if process_alive(holder.pid, holder.host) is not None:
        return f"the run lock of {holder.describe()} is stale (that process has ended)"
    quiet = time.time() - holder.heartbeat
    return (f"the run lock of {holder.describe()} is stale (no heartbeat for {quiet:.0f} s, over "
            f"{STALE_AFTER_SECONDS:.0f} s)")


class RunLock:
    """A held lock: refreshed by a daemon thread, released (removed if still ours) by ``release``."""

    def __init__(self, path: Path, record: dict[str, Any]) -> None:
        self.path = path
        self.record = record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="shardtune-run-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def still_ours(self) -> bool:
        try:
            return json.loads(self.path.read_text()) == self.record
        except (OSError, ValueError):
            return False

    def release(self) -> None:
        self._stop.set()
        if self.still_ours():
            self.path.unlink(missing_ok=True)


def acquire_run_lock(output_dir: Path, job: str | None = None) -> RunLock:
    """Take ``output_dir``'s lock for this process, taking a stale one over; ConfigError when a live run holds it."""
    path = lock_path(output_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"output_dir: cannot create {path.parent} ({err.strerror}); choose a writable "
                          "output_dir") from None
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "job": job}
    for _ in range(3):  # the lock went away between our link and our look: link again
        if _link_new_lock(path, record):
            return RunLock(path, record)
        with _taking_over(path):  # one process at a time judges and removes a stale lock
            holder = read_holder(output_dir)
            if holder is None:
                continue
            if job is not None and holder.job == job:  # another process of this job took it: share it
                return _SharedLock(path, record)
            if holder.alive():
                raise ConfigError(live_run_message(output_dir, holder))
            _remove_stale(path, holder)
            if _link_new_lock(path, record):
                return RunLock(path, record)
    raise ConfigError(f"output_dir: {output_dir}: could not take the run lock ({path}): other runs keep taking it "
                      "over; start one run per output_dir")


@contextlib.contextmanager
def _taking_over(path: Path) -> Iterator[None]:
    """Hold the take-over mutex: an advisory lock on a file beside the lock, dropped by the kernel if this process
    dies (Linux NFS clients map it to a lock the server keeps). Without it, two runs that both judged a lock stale
    could each remove what the other had just put in its place, and both win."""
    with open(path.with_name(path.name + ".takeover"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _SharedLock(RunLock):
    """A lock another process of the same job holds: nothing to refresh or release here."""

    def __init__(self, path: Path, record: dict[str, Any]) -> None:
        self.path = path
        self.record = record

    def release(self) -> None:
        pass


def _link_new_lock(path: Path, record: dict[str, Any]) -> bool:
    """Create the lock with ``record`` in it, whole; False when a lock is already there."""
    private = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.new")
    private.write_text(json.dumps(record))
    try:
        os.link(private, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here (some FUSE and object-store mounts): an exclusive create instead
        return _create_new_lock(path, record)
    finally:
        private.unlink(missing_ok=True)


def _create_new_lock(path: Path, record: dict[str, Any]) -> bool:
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as handle:
        handle.write(json.dumps(record))
    return True


def _remove_stale(path: Path, stale: LockHolder) -> None:
    """Remove the lock judged stale, only if it is still that one (moved aside first, a rename being atomic; the
    lock of a run that linked in meanwhile is put back)."""
    aside = path.with_name(f"{path.name}.stale.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        moved = json.loads(aside.read_text())
    except (OSError, ValueError):
        moved = None
    was_stale = not isinstance(moved, dict) or (moved.get("pid"), moved.get("host")) == (stale.pid, stale.host)
    if not was_stale:
        with contextlib.suppress(FileExistsError, OSError):
            os.link(aside, path)
    aside.unlink(missing_ok=True)


@contextlib.contextmanager
def holding_run_lock(output_dir: Path, job: str | None = None) -> Iterator[RunLock]:
    """Hold ``output_dir``'s lock for the block; released when it ends, however it ends."""
    lock = acquire_run_lock(output_dir, job)
    try:
        yield lock
    finally:
        lock.release()
