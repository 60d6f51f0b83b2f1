"""A failed rank: one report line, its traceback in a file, torchrun's own account of it dropped on the host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from shardtune.launch.failures import (
    FailureKind,
    classify_failure,
    error_file,
    failure_summary,
    is_consequence,
    peer_failed_since,
    report_rank_failure,
    saved_failure_report,
)
from shardtune.launch.launcher_output import LauncherOutput, RankExit
from shardtune.launch.torchrun import worker_argv

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:59009. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "5000ms for recv operation to complete")

# torchrun's stderr after rank 1 failed (torch 2.13), as the launching host receives it.
TORCHRUN_TAIL = """\
W1122 18:21:41.082000 27381 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 27383 closing signal SIGTERM
E1122 18:21:41.148000 27381 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 27384) of binary: /work/main/.venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\x20
============================================================
shardtune.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_18:21:41
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 27383)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 27383
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_18:21:41
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 27384)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""  # noqa: E501

REPORT = "[shardtune] rank 1 failed: RuntimeError: boom (full traceback: out/.shardtune/rank-1-error.txt)\n"
BAR = "train:   5%|▌         | 1/20 [00:00<00:01, 11.14it/s, loss=7.9131]"


def filtered(*chunks: str) -> tuple[str, LauncherOutput]:
    output = LauncherOutput()
    return "".join(output.feed(chunk) for chunk in chunks) + output.finish(), output


@pytest.mark.parametrize(("message", "kind"), [
    ("boom", FailureKind.OWN),
    (GLOO_CLOSED, FailureKind.PEER_LOST),
    ("NCCL error: remote process exited or there was a network error", FailureKind.PEER_LOST),
    (GLOO_TIMEOUT, FailureKind.TIMED_OUT),
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)", FailureKind.TIMED_OUT),
])
def test_failures_are_told_apart(message, kind):
    assert classify_failure(RuntimeError(message)) is kind


def test_a_value_error_about_a_timeout_is_the_rank_own():
    assert classify_failure(ValueError("timed out waiting for the tokenizer")) is FailureKind.OWN


def test_timeout_summary_names_ddp_timeout():
    line = failure_summary(RuntimeError(GLOO_TIMEOUT), 0, 5)
    assert line.startswith("[shardtune] rank 0 failed: a collective waited longer than ddp_timeout (5 s)")


def raised(err: Exception) -> Exception:
    try:
        raise err
    except Exception as caught:
        return caught


def test_own_failure_prints_one_line_and_saves_the_traceback(tmp_path, capsys):
    assert report_rank_failure(raised(RuntimeError("boom\nsecond line")), 1, tmp_path, 1800) == 1
    err = capsys.readouterr().err
    path = error_file(tmp_path, 1)
    assert err == f"[shardtune] rank 1 failed: RuntimeError: boom (full traceback: {path})\n"
    saved = path.read_text()
    assert saved.startswith("[shardtune] rank 1 failed: RuntimeError: boom\n") and "Traceback" in saved


def test_a_rank_that_only_lost_its_peer_is_silent(tmp_path, capsys):
    report_rank_failure(raised(RuntimeError(GLOO_CLOSED)), 0, tmp_path, 1800)
    assert capsys.readouterr().err == ""
    assert "Connection closed by peer" in error_file(tmp_path, 0).read_text()


def test_error_files_count_only_when_newer_than_the_rank(tmp_path):
    report_rank_failure(raised(RuntimeError(GLOO_CLOSED)), 0, tmp_path, 1800)
    old = time.time() - 3600
    os.utime(error_file(tmp_path, 0), (old, old))
    assert not peer_failed_since(tmp_path, time.time() - 60)
    assert saved_failure_report(tmp_path, 0, time.time() - 60) is None
    assert peer_failed_since(tmp_path, old - 1)
    assert saved_failure_report(tmp_path, 0, old - 1).startswith("[shardtune] rank 0 failed: lost the connection")


STOPPED_RANK = """
import sys, time
from pathlib import Path
from shardtune.launch.worker import install_stop_handlers
from shardtune.train.workflow import StopRequest
install_stop_handlers(StopRequest(), Path(sys.argv[1]), float(sys.argv[2]), rank=1)
print("ready", flush=True)
time.sleep(60)
"""


def stop_a_rank(run_dir, started: float) -> int:
    """A child with the rank's stop handlers, stopped by SIGTERM as torchrun stops ranks; its exit code."""
    child = subprocess.Popen([sys.executable, "-c", STOPPED_RANK, str(run_dir), str(started)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    return child.wait(timeout=60)


def test_a_rank_stopped_after_a_peer_failed_leaves_a_report_and_dies_by_the_signal(tmp_path):
    started = time.time() - 1
    report_rank_failure(raised(AssertionError("checkpoint-30 was not written by shardtune")), 0, tmp_path, 1800)
    assert stop_a_rank(tmp_path, started) == -signal.SIGTERM
    stopped = saved_failure_report(tmp_path, 1, started)
    assert stopped.startswith("[shardtune] rank 1 failed: stopped by the launcher after another rank failed")
    assert is_consequence(stopped) and not is_consequence(saved_failure_report(tmp_path, 0, started))


def test_a_stopped_rank_keeps_its_own_report(tmp_path):
    started = time.time() - 1
    report_rank_failure(raised(RuntimeError("boom")), 0, tmp_path, 1800)
    report_rank_failure(raised(RuntimeError(GLOO_CLOSED)), 1, tmp_path, 1800)
    assert stop_a_rank(tmp_path, started) == -signal.SIGTERM
    assert "Connection closed by peer" in error_file(tmp_path, 1).read_text()


def test_a_report_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """The page and the peers poll the error files: one read between a report's creation and its write showed a
    rank's error without its line (CI, 2026-11-28). The report is written aside and renamed into place."""
    from pathlib import Path

    from shardtune.launch import failures
    from shardtune.web.runs import rank_errors

    seen: list[str] = []
    placed: list[Path] = []
    real_replace = failures.os.replace

    def replace(source, target):  # just before the report appears: what would a poll find?
        seen.extend(path.name for path in Path(target).parent.glob("rank-*-error.txt"))
        placed.append(Path(target))
        real_replace(source, target)

    monkeypatch.setattr(failures.os, "replace", replace)
    started = time.time() - 1
    report_rank_failure(raised(RuntimeError("boom")), 0, tmp_path, 1800)
    assert placed == [error_file(tmp_path, 0)] and seen == []  # written aside, then renamed into place
    assert error_file(tmp_path, 0).read_text().startswith("[shardtune] rank 0 failed: RuntimeError")
    assert not list(error_file(tmp_path, 0).parent.glob("*.partial"))
    error_file(tmp_path, 1).write_text("")  # another writer's report, read before its line
    assert [e["rank"] for e in rank_errors(tmp_path, started)] == [0]


def test_torchrun_account_is_dropped_and_its_table_read():
    shown, output = filtered(REPORT, TORCHRUN_TAIL)
    assert shown == REPORT
    assert output.any_rank_reported
    assert output.failed_ranks() == [RankExit(1, -9), RankExit(0, -15)]
    assert output.failed_ranks()[0].describe().startswith("rank 1 was killed by SIGKILL")


def test_the_same_report_from_several_ranks_is_shown_once():
    timeout = "[shardtune] rank {} failed: a collective waited longer than ddp_timeout (5 s) (rank-{}-error.txt)\n"
    error = "shardtune: error: lora_target: q_prj not found in the model\n"
    shown, _ = filtered(timeout.format(0, 0), error, timeout.format(2, 2), error, REPORT)
    assert shown == timeout.format(0, 0) + error + REPORT


def test_a_notice_written_into_an_unfinished_report_does_not_make_it_a_second_one():
    """Seen in CI: torchrun's SIGTERM reached a rank between its error line's text and newline."""
    error = "shardtune: error: lora_target: q_prj not found in the model"
    notice = "[shardtune] SIGTERM: stopping after this step and saving a checkpoint\n"
    shown, _ = filtered(error + "\n", error + notice, "\n")
    assert shown == error + "\n" + notice + "\n"


def test_progress_bars_pass_at_once_and_a_report_starts_its_own_line():
    output = LauncherOutput()
    assert output.feed("\r" + BAR) == "\r" + BAR
    assert output.feed(REPORT) == "\n" + REPORT


def test_a_report_split_across_reads_is_still_recognised():
    shown, output = filtered("\r" + BAR + REPORT[:12], REPORT[12:], REPORT)
    assert shown == "\r" + BAR + "\n" + REPORT
    assert output.any_rank_reported


def test_other_tracebacks_pass_unchanged():
    text = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
            "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: waiting for clients\n")
    rank_traceback = "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"y.py\"\n[rank1]: KeyError: 1\n"
    shown, output = filtered(text, rank_traceback, "done\n")
    assert shown == text + rank_traceback + "done\n"
    assert output.failed_ranks() == []


def test_worker_gets_debug_switch():
    assert worker_argv("c.json", debug=True)[-1] == "--debug"
    assert "--debug" not in worker_argv("c.json")


def test_host_names_a_killed_rank_when_no_rank_could_report(tmp_path, capsys):
    from shardtune.launch.supervise import report_launch_failure

    _, output = filtered(TORCHRUN_TAIL)
    assert report_launch_failure(1, output, tmp_path, time.time()) == 1
    assert capsys.readouterr().err.startswith("shardtune: error: rank 1 was killed by SIGKILL")


def test_host_shows_the_saved_report_of_a_rank_that_could_not_print_it(tmp_path, capsys):
    from shardtune.launch.supervise import report_launch_failure

    started = time.time() - 1
    report_rank_failure(raised(RuntimeError(GLOO_CLOSED)), 1, tmp_path, 1800)  # silent: it only lost its peer
    capsys.readouterr()
    _, output = filtered(TORCHRUN_TAIL.replace("exitcode  : -9", "exitcode  : 1"))
    assert report_launch_failure(1, output, tmp_path, started) == 1
    assert capsys.readouterr().err.startswith("[shardtune] rank 1 failed: lost the connection to another rank")


def test_host_is_quiet_after_a_report_and_says_2_for_bad_input(tmp_path, capsys):
    from shardtune.launch.supervise import report_launch_failure

    _, output = filtered("shardtune: error: lora_target: q_prj not found\n",
                         TORCHRUN_TAIL.replace("exitcode  : -9", "exitcode  : 2"))
    assert report_launch_failure(1, output, tmp_path, time.time()) == 2
    assert capsys.readouterr().err == ""


# ---- NCCL: the watchdog ends a rank (SIGABRT) before any Python exception; these are its real log lines ----

# torch 2.6-2.13 ProcessGroupNCCL, a collective that never completed (another rank stuck), as torchrun prefixes it.
NCCL_TIMEOUT_LOG = """\
[rank1]:[E1218 20:27:21.484959605 ProcessGroupNCCL.cpp:629] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.
[rank1]:[E1218 20:27:21.484959605 ProcessGroupNCCL.cpp:681] [Rank 1] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.
[rank1]:[E1218 20:27:21.484966856 ProcessGroupNCCL.cpp:695] [Rank 1] To avoid data inconsistency, we are taking the entire process down.
[rank1]:[E1218 20:27:21.486305774 ProcessGroupNCCL.cpp:1895] [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.
Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:632 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f1c4a76c1b8 in /usr/lib/python3/dist-packages/torch/lib/libc10.so)
terminate called after throwing an instance of 'c10::DistBackendError'
"""  # noqa: E501
# torch 2.3 ProcessGroupNCCL after a peer process died (NCCL's socket transport saw the connection close).
NCCL_PEER_LOST_LOG = """\
[rank1]:[E ProcessGroupNCCL.cpp:577] [Rank 1] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.
[rank1]:[E ProcessGroupNCCL.cpp:583] [Rank 1] To avoid data inconsistency, we are taking the entire process down.
[rank1]:[E ProcessGroupNCCL.cpp:1414] [PG 0 Rank 1] Process group watchdog thread terminated with exception: NCCL error: remote process exited or there was a network error, NCCL version 2.20.5
ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.
Last error:
socketProgress: Connection closed by remote peer gpu-node1<45074>
terminate called after throwing an instance of 'c10::DistBackendError'
"""  # noqa: E501
ABORTED_TAIL = TORCHRUN_TAIL.replace("exitcode  : -9 (pid: 27384)", "exitcode  : -6 (pid: 27384)")


@pytest.mark.parametrize(("message", "kind"), [
    ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, remote process exited or there was a "
     "network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a "
     "remote process exiting prematurely.", FailureKind.PEER_LOST),
    ("[Rank 1] NCCL communicator was aborted on rank 1.", FailureKind.PEER_LOST),
    ("[PG 0 Rank 25] Heartbeat monitor timed out! Process will be terminated after dumping debug info. "
     "workMetaList_.size()=2", FailureKind.TIMED_OUT),
])
def test_nccl_exceptions_are_told_apart(message, kind):
    assert classify_failure(RuntimeError(message)) is kind


def test_two_ranks_on_one_gpu_are_named():
    err = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1275, invalid usage (run with NCCL_DEBUG=WARN for "
                       "details), NCCL version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL "
                       "library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000")
    assert failure_summary(err, 1, 1800) == (
        "[shardtune] rank 1 failed: two ranks are on one GPU (NCCL: Duplicate GPU detected): start one process per "
        "GPU (NPROC_PER_NODE, CUDA_VISIBLE_DEVICES, Ray's resources_per_worker GPU: 1)")


@pytest.mark.parametrize(("log", "expected"), [
    (NCCL_TIMEOUT_LOG, "[shardtune] rank 1 failed: NCCL's watchdog ended the process: collective ALLREDUCE (#9, "
                       "timeout 600 s) waited longer than the process group timeout (ddp_timeout): another rank is "
                       "stuck or died; raise ddp_timeout if a step legitimately takes that long"),
    (NCCL_PEER_LOST_LOG, "[shardtune] rank 1 failed: NCCL's watchdog ended the process: it lost the connection to "
                         "another rank, which failed or was killed first (or the network between the nodes failed)"),
])
def test_host_reports_a_rank_the_nccl_watchdog_aborted(log, expected, tmp_path, capsys):
    """The rank died by SIGABRT and wrote no report: the host reads the watchdog's lines instead of saying only
    that rank 1 was killed by SIGABRT."""
    from shardtune.launch.supervise import report_launch_failure

    shown, output = filtered(log, ABORTED_TAIL)
    assert shown == log  # the watchdog's own lines still pass
    assert report_launch_failure(1, output, tmp_path, time.time()) == 1
    assert capsys.readouterr().err == expected + "\n"


def test_a_rank_killed_first_stays_the_cause_over_the_watchdog(tmp_path, capsys):
    """rank 1 was killed (SIGKILL, out of memory); rank 0's watchdog then lost it: the kill is the news."""
    from shardtune.launch.supervise import report_launch_failure

    _, output = filtered(NCCL_PEER_LOST_LOG.replace("rank1]", "rank0]").replace("Rank 1]", "Rank 0]"), TORCHRUN_TAIL)
    assert report_launch_failure(1, output, tmp_path, time.time()) == 1
    assert capsys.readouterr().err.startswith("shardtune: error: rank 1 was killed by SIGKILL")
