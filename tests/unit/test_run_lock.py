"""The run lock (launch/run_lock.py): one live run per output_dir; stale locks taken over, live ones refused."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.errors import ConfigError
from shardtune.launch import run_lock
from shardtune.launch.env import run_job_id
from shardtune.launch.run_lock import acquire_run_lock, live_run_problems, lock_path, read_holder, stale_lock_warning


def write_lock(out: Path, **record) -> Path:
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def ended_pid() -> int:
    """The process id of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_held_lock_refuses_a_second_run_and_is_removed_on_release(tmp_path):
    lock = acquire_run_lock(tmp_path)
    holder = read_holder(tmp_path)
    assert holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname()
    with pytest.raises(ConfigError) as refused:
        acquire_run_lock(tmp_path)
    message = refused.value.problems[0]
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message and "shardtune status" in message
    assert live_run_problems(tmp_path) == [message]
    lock.release()
    assert not lock_path(tmp_path).exists() and live_run_problems(tmp_path) == []


def test_a_dead_holder_on_this_host_is_stale_and_taken_over(tmp_path):
    write_lock(tmp_path, host=socket.gethostname(), pid=ended_pid(), started=time.time() - 60, job=None)
    assert live_run_problems(tmp_path) == []
    assert "that process has ended" in (stale_lock_warning(tmp_path) or "")
    lock = acquire_run_lock(tmp_path)
    assert read_holder(tmp_path).pid == os.getpid()
    lock.release()


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path):
    """This very process, but the lock says its holder started before this process did: another process."""
    write_lock(tmp_path, host=socket.gethostname(), pid=os.getpid(), started=1000.0, job=None)
    assert live_run_problems(tmp_path) == []


def test_a_holder_on_another_host_lives_by_its_heartbeat(tmp_path):
    path = write_lock(tmp_path, host="other-node", pid=1234, started=time.time() - 3600, job=None)
    assert "pid 1234 on other-node" in live_run_problems(tmp_path)[0]  # just touched: alive
    old = time.time() - run_lock.STALE_AFTER_SECONDS - 5
    os.utime(path, (old, old))
    assert live_run_problems(tmp_path) == []
    assert "no heartbeat" in (stale_lock_warning(tmp_path) or "")
    # A rank log written recently is a heartbeat too: the run is alive though its lock thread fell behind.
    log = tmp_path / "ranks" / "rank_0.jsonl"
    log.parent.mkdir()
    log.write_text("{}\n")
    assert live_run_problems(tmp_path) != []


def test_an_unreadable_lock_names_nobody_alive(tmp_path):
    lock_path(tmp_path).parent.mkdir(parents=True)
    lock_path(tmp_path).write_text("{not json")
    old = time.time() - 60  # (one just written may still be getting its record: see the test below)
    os.utime(lock_path(tmp_path), (old, old))
    assert live_run_problems(tmp_path) == []
    acquire_run_lock(tmp_path).release()


def test_the_processes_of_one_job_share_the_lock(tmp_path):
    lock = acquire_run_lock(tmp_path, job="ranks@h:1/x/2")
    assert live_run_problems(tmp_path, job="ranks@h:1/x/2") == []
    acquire_run_lock(tmp_path, job="ranks@h:1/x/2").release()  # shared: releasing it leaves the holder's lock
    assert lock_path(tmp_path).exists()
    assert live_run_problems(tmp_path, job="ranks@h:2/y/2") != []
    lock.release()


def test_the_heartbeat_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_SECONDS", 0.05)
    lock = acquire_run_lock(tmp_path)
    os.utime(lock.path, (1000.0, 1000.0))
    deadline = time.time() + 10
    while lock.path.stat().st_mtime < time.time() - 60 and time.time() < deadline:
        time.sleep(0.05)
    assert lock.path.stat().st_mtime > time.time() - 60
    lock.release()


def test_a_taken_over_lock_is_not_removed_by_its_old_holder(tmp_path):
    lock = acquire_run_lock(tmp_path)
    write_lock(tmp_path, host="other-node", pid=99, started=time.time(), job=None)
    lock.release()
    assert read_holder(tmp_path).host == "other-node"


def _race(out: str, start: float, results) -> None:
    while time.time() < start:
        time.sleep(0.001)
    try:
        acquire_run_lock(Path(out))
        results.put("won")
        time.sleep(1.0)  # hold it while the others try
    except ConfigError:
        results.put("refused")


@pytest.mark.parametrize("stale", [False, True])
def test_runs_that_start_together_get_one_lock(tmp_path, stale):
    """Processes racing for a free folder, or for one whose stale lock each of them wants to take over."""
    if stale:
        write_lock(tmp_path, host=socket.gethostname(), pid=ended_pid(), started=time.time() - 60, job=None)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    start = time.time() + 0.5
    racers = [context.Process(target=_race, args=(str(tmp_path), start, results)) for _ in range(6)]
    for racer in racers:
        racer.start()
    outcomes = sorted(results.get(timeout=60) for _ in racers)
    for racer in racers:
        racer.join(timeout=30)
    assert outcomes == ["refused"] * 5 + ["won"]


def test_job_ids_tell_jobs_apart():
    ranks = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
             "TORCHELASTIC_RUN_ID": "abc"}
    assert run_job_id(ranks) == run_job_id({**ranks, "RANK": "0"})  # ranks of one job agree
    assert run_job_id(ranks) != run_job_id({**ranks, "MASTER_PORT": "29501"})
    assert run_job_id({}) is None  # one node started by shardtune: its launching process alone holds the lock
    nodes = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert run_job_id(nodes) == run_job_id({**nodes, "NODE_RANK": "0"})


def test_status_names_the_lock_holder(tmp_path):
    from shardtune.web.status import lock_line

    assert lock_line(tmp_path) is None
    lock = acquire_run_lock(tmp_path)
    assert f"held by pid {os.getpid()} on {socket.gethostname()}" in (lock_line(tmp_path) or "")
    lock.release()
    write_lock(tmp_path, host=socket.gethostname(), pid=ended_pid(), started=time.time() - 60, job=None)
    assert "no longer runs" in (lock_line(tmp_path) or "")


def test_a_filesystem_without_hard_links_gets_an_exclusive_create(tmp_path, monkeypatch):
    def no_links(source, target):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    lock = acquire_run_lock(tmp_path)
    assert read_holder(tmp_path).pid == os.getpid()
    with pytest.raises(ConfigError):
        acquire_run_lock(tmp_path)
    lock.release()
    assert not lock_path(tmp_path).exists()


def test_a_lock_being_written_is_not_taken_for_stale(tmp_path):
    lock_path(tmp_path).parent.mkdir(parents=True)
    lock_path(tmp_path).write_text("")  # an exclusive create, its record not yet written
    assert live_run_problems(tmp_path) != []
    old = time.time() - 60
    os.utime(lock_path(tmp_path), (old, old))
    assert live_run_problems(tmp_path) == []
