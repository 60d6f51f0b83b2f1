"""Reading a run folder for `shardtune status` and `shardtune web`: the rank rows and their flags, the run's state,
checkpoints and resume commands, and the page's refusal of anything outside its root (synthetic run folders)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shardtune.train.rank_log import RankLog, rank_log_path
from shardtune.web.rank_table import read_rank_logs
from shardtune.web.runs import RunWatcher, checkpoints, config_diff, find_runs, run_summary
from shardtune.web.status import format_status


def write_rank(out, rank, steps, *, step_s=0.1, wait_s=0.0, end=None, start_time=None, pid=None, total=100):
    now = start_time or time.time() - steps * step_s  # after this process started (its pid is the rank's)
    lines = [{"time": now, "event": "start", "rank": rank, "world_size": 2, "host": socket.gethostname(),
              "pid": pid or os.getpid(), "total_steps": total, "step": 0, "estimate_peak_bytes": 1000,
              "baseline_rss": 100}]
    for step in range(1, steps + 1):
        now += step_s
        lines.append({"time": now, "event": "step", "step": step, "step_s": step_s, "wait_s": wait_s, "data_s": 0.0,
                      "loss": 2.0, "tokens": 10, "tokens_per_s": 10 / step_s, "rss": 600})
    if end is not None:
        lines.append({"time": now, "event": "end", "step": steps, "interrupted": end == "interrupted"})
    path = rank_log_path(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_rank_the_others_wait_for_is_the_straggler(tmp_path):
    # Rank 1 takes 0.5 s of its own per step; ranks 0 and 2 spend 0.4 s of their 0.5 s step waiting for it.
    write_rank(tmp_path, 0, 8, step_s=0.5, wait_s=0.4)
    write_rank(tmp_path, 1, 8, step_s=0.5, wait_s=0.0)
    write_rank(tmp_path, 2, 8, step_s=0.5, wait_s=0.4)
    rows = run_summary(tmp_path, read_rank_logs(tmp_path / "ranks"))["ranks"]
    assert [r["straggler"] for r in rows] == [False, True, False]
    assert rows[1]["own_s"] == pytest.approx(0.5) and rows[0]["own_s"] == pytest.approx(0.1)


def test_a_rank_that_stalls_every_few_steps_is_the_straggler(tmp_path):
    # Rank 1's loader stalls one step in three (1.2 s of its own), its other steps are as fast as rank 0's.
    write_rank(tmp_path, 0, 6, step_s=0.1)
    write_rank(tmp_path, 1, 6, step_s=0.1)
    path = rank_log_path(tmp_path, 1)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if record.get("step") in (3, 6) and record["event"] == "step":
            record["step_s"] = 1.2
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    rows = run_summary(tmp_path, read_rank_logs(tmp_path / "ranks"))["ranks"]
    assert [r["straggler"] for r in rows] == [False, True]


def test_even_ranks_have_no_straggler_and_a_silent_rank_is_stalled(tmp_path):
    write_rank(tmp_path, 0, 5, step_s=0.2, start_time=time.time() - 1)
    write_rank(tmp_path, 1, 5, step_s=0.2, start_time=time.time() - 100)  # its last record is 99 s old
    summary = run_summary(tmp_path, read_rank_logs(tmp_path / "ranks"))
    assert [(r["straggler"], r["stalled"]) for r in summary["ranks"]] == [(False, False), (False, True)]
    assert summary["state"] == "stalled"


def test_states_running_finished_stopped_and_killed(tmp_path):
    running = tmp_path / "running"
    write_rank(running, 0, 3)
    write_rank(running, 1, 3)
    assert RunWatcher(running).summary()["state"] == "running"
    stopped = tmp_path / "stopped"
    write_rank(stopped, 0, 3, end="interrupted")
    write_rank(stopped, 1, 3, end="interrupted")
    assert RunWatcher(stopped).summary()["state"] == "stopped"
    finished = tmp_path / "finished"
    write_rank(finished, 0, 3, end="done")
    (finished / "train_results.json").write_text(json.dumps({"global_step": 3, "final_loss": 1.5}))
    assert RunWatcher(finished).summary()["state"] == "finished"
    killed = tmp_path / "killed"
    write_rank(killed, 0, 3, pid=2 ** 22 + 12345)  # no such process on this host, and no end record
    assert RunWatcher(killed).summary()["state"] == "exited"


def test_failed_run_shows_the_ranks_own_error_first(tmp_path):
    write_rank(tmp_path, 0, 2)
    write_rank(tmp_path, 1, 2)
    errors = tmp_path / ".shardtune"
    errors.mkdir()
    (errors / "rank-0-error.txt").write_text("[shardtune] rank 0 failed: lost the connection to another rank, "
                                            "which failed or was killed first\n\nTraceback ...")
    (errors / "rank-1-error.txt").write_text("[shardtune] rank 1 failed: ValueError: bad batch\n\nTraceback ...")
    summary = RunWatcher(tmp_path).summary()
    assert summary["state"] == "failed"
    assert summary["errors"][0]["summary"] == "[shardtune] rank 1 failed: ValueError: bad batch"
    assert "last error: [shardtune] rank 1 failed: ValueError: bad batch" in format_status(tmp_path, summary)


def test_checkpoints_complete_or_not_with_the_resume_command(tmp_path):
    (tmp_path / "checkpoint-10").mkdir()
    (tmp_path / "checkpoint-10" / "COMPLETE").write_text("")
    (tmp_path / "checkpoint-10" / "weights.bin").write_bytes(b"x" * 1000)
    (tmp_path / "checkpoint-20").mkdir()  # interrupted mid-save
    launch = {"cwd": "/work", "command_line": ["cfg.yaml", "max_steps=30"], "nnodes": 1, "nproc_per_node": 2}
    found = checkpoints(tmp_path, launch)
    assert [(c["name"], c["complete"]) for c in found] == [("checkpoint-10", True), ("checkpoint-20", False)]
    assert found[0]["size_bytes"] == 1000 and found[1]["resume_command"] is None
    assert found[0]["resume_command"] == ("cd /work && NPROC_PER_NODE=2 shardtune train cfg.yaml max_steps=30 "
                                          f"resume_from_checkpoint={(tmp_path / 'checkpoint-10').resolve()} "
                                          "overwrite_output_dir=false")


def test_reader_reads_only_what_was_appended_and_restarts_on_a_resume(tmp_path):
    log = RankLog(rank_log_path(tmp_path, 0), 0)
    log.start(world_size=1, total_steps=10, start_step=0, estimate_peak_bytes=None)
    log.step(1, {"loss": 2.0, "local_tokens": 5.0}, 0.0)
    watcher = RunWatcher(tmp_path)
    assert watcher.summary()["step"] == 1
    log.step(2, {"loss": 1.5, "local_tokens": 5.0}, 0.0)
    log.close(2, interrupted=True)
    log = RankLog(rank_log_path(tmp_path, 0), 0)  # the run resumed from step 2
    log.start(world_size=1, total_steps=10, start_step=2, estimate_peak_bytes=None)
    log.step(3, {"loss": 1.0, "local_tokens": 5.0}, 0.0)
    summary = watcher.summary()
    assert (summary["step"], summary["state"], summary["ranks"][0]["loss"]) == (3, "running", 1.0)
    log.close(3, interrupted=False)


def test_runs_are_found_under_the_root_and_configs_compared(tmp_path):
    write_rank(tmp_path / "a" / "run1", 0, 1)
    (tmp_path / "b" / "deeper" / "run2").mkdir(parents=True)
    (tmp_path / "b" / "deeper" / "run2" / "shardtune_config.json").write_text("{}")
    (tmp_path / "a" / "run1" / "checkpoint-1" / "ranks").mkdir(parents=True)  # inside a run: not a run
    assert sorted(p.relative_to(tmp_path).as_posix() for p in find_runs(tmp_path)) == ["a/run1", "b/deeper/run2"]
    assert config_diff({"lr": 1, "x": 2}, {"lr": 3, "x": 2, "y": 4}) == [{"key": "lr", "a": 1, "b": 3},
                                                                         {"key": "y", "a": None, "b": 4}]


def test_the_page_reads_no_folder_outside_its_root(tmp_path):
    pytest.importorskip("starlette")
    from shardtune.web.server import WebState

    write_rank(tmp_path / "root" / "run", 0, 1)
    write_rank(tmp_path / "outside", 0, 1)
    (tmp_path / "root" / "link").symlink_to(tmp_path / "outside")
    state = WebState(tmp_path / "root", 1.0)
    assert state.run_folder("run") == (tmp_path / "root" / "run").resolve()
    for escape in ("../outside", "link", str(tmp_path / "outside"), "run/../../outside", None, "missing"):
        assert state.run_folder(escape) is None, escape


def test_a_long_run_refreshes_reading_only_what_was_appended(tmp_path, monkeypatch):
    """The reads the page repeats (the run's detail every half second, its curves when rank 0 logs, the run list
    every 3 s) on 2 ranks x 50k steps and a 50k-line trainer log: after the first look each reads only the new lines,
    well under a second (docs/watching.md quotes what this prints)."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from shardtune.web.server import build_app

    steps = 50_000
    for rank in (0, 1):
        write_rank(tmp_path / "long", rank, steps, total=2 * steps)
    log = tmp_path / "long" / "trainer_log.jsonl"
    log.write_text("".join(f'{{"current_steps": {s}, "loss": 2.0, "learning_rate": 1e-05}}\n'
                           for s in range(1, steps + 1)))
    page = TestClient(build_app(tmp_path, "tok"), base_url="http://127.0.0.1:7860",
                      headers={"x-shardtune-token": "tok"})
    reads = ("/api/run?id=long", "/api/curves?id=long", "/api/runs")
    for url in reads:  # the first look reads everything
        assert page.get(url).status_code == 200
    for rank in (0, 1):
        with rank_log_path(tmp_path / "long", rank).open("a") as f:
            f.write(json.dumps({"time": time.time(), "event": "step", "step": steps + 1, "step_s": 0.1}) + "\n")
    with log.open("a") as f:
        f.write(json.dumps({"current_steps": steps + 1, "loss": 1.5}) + "\n")
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(json, "loads", lambda text, **kw: parsed.append(1) or real_loads(text, **kw))
    seconds = {}
    for url in reads:
        began = time.perf_counter()
        answer = page.get(url)
        seconds[url] = time.perf_counter() - began
        assert answer.status_code == 200
    monkeypatch.undo()
    print(" ".join(f"{url}: {value * 1000:.0f} ms" for url, value in seconds.items()))
    assert len(parsed) < 50, f"the refresh parsed {len(parsed)} JSON texts for 3 appended lines"
    assert max(seconds.values()) < 1.0, seconds
    assert page.get(reads[0]).json()["step"] == steps + 1
    assert page.get(reads[1]).json()["curves"]["loss"][-1] == [steps + 1, 1.5]


def test_web_without_its_extra_is_refused_with_the_install_line(monkeypatch):
    from shardtune.errors import ConfigError
    from shardtune.web import command

    monkeypatch.setattr(command.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install 'shardtune\[web\]'"):
        command.web_command(["."])


def test_web_binds_to_this_machine_and_prints_the_ssh_line():
    from shardtune.web.command import serving_lines

    local = serving_lines(Path("/runs"), "127.0.0.1", 7860, "tok")
    assert "open http://127.0.0.1:7860/?token=tok" in local and "ssh -N -L 7860:127.0.0.1:7860 " in local
    assert "warning: listening on 0.0.0.0" in serving_lines(Path("/r"), "0.0.0.0", 80, "t")


def test_the_cheap_commands_do_not_import_the_web_stack_or_torch():
    code = ("import sys; from shardtune.cli import main; main(['--help']); main(['status', sys.argv[1]]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn', 'torch', 'wandb')))")
    with tempfile.TemporaryDirectory() as folder:
        write_rank(Path(folder), 0, 1)
        done = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
