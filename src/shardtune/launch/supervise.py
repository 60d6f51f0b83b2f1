"""Start a planned run and see it through: in this process, or torchrun on this node with its signals and failures.

`shardtune train`: cli -> ``plan_run`` (launch/preflight.py) -> ``start_run`` here -> the dry-run report, the run in
this process (launch/worker.py), or torchrun's argv (launch/torchrun.py, pure) started and supervised.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from shardtune import run_files
from shardtune.engines.plan import spec_for
from shardtune.errors import ConfigError
from shardtune.host import visible_gpu_count
from shardtune.launch import env as launch_env
from shardtune.launch.failures import saved_failure_report
from shardtune.launch.launcher_output import LauncherOutput, RankExit, pump
from shardtune.launch.nodes import check_nodes
from shardtune.launch.preemption import (
    INTERRUPTED_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    STOP_NOTICE,
    STOP_SIGNALS,
    exit_code_for,
)
from shardtune.launch.preflight import RunPlan, run_plan_dict, write_run_plan
from shardtune.launch.run_lock import holding_run_lock
from shardtune.launch.torchrun import LaunchPlan, build_torchrun_argv, worker_argv


def start_run(plan: RunPlan, debug: bool = False, command_line: list[str] | None = None) -> int:
    """Run the launching host's plan; the exit code of the run (130 when interrupted, 2 for bad input).
    ``command_line``: the arguments of `shardtune train`, recorded for `shardtune status` and `shardtune web`."""
    launch = plan.launch
    assert launch is not None, "start_run needs the launching host's plan"
    if launch.use_ray:
        from shardtune.launch.ray_job import start_ray_run

        if "dry_run" in plan.switches:
            return start_ray_run(plan, debug)
        with holding_run_lock(plan.run_dir, launch_env.run_job_id()):
            return start_ray_run(plan, debug)
    use_torchrun = launch.force_torchrun or plan.layout.world_size > 1 or plan.engine.needs_process_group
    plan_path = plan.run_dir / run_files.LAUNCH_PLAN
    commands = [build_torchrun_argv(launch, node, worker_argv(str(plan_path), debug), sys.executable)
                for node in range(launch.nnodes)] if use_torchrun else []
    if "dry_run" in plan.switches:
        from shardtune.launch.report import dry_run_report

        print(dry_run_report(plan, commands))
        return 0
    if launch.node_rank != 0:  # node 0 holds the run's lock; the others join its job
        return run_planned(plan, commands, use_torchrun, command_line, debug)
    with holding_run_lock(plan.run_dir, launch_env.run_job_id()):
        return run_planned(plan, commands, use_torchrun, command_line, debug)


def run_planned(plan: RunPlan, commands: list[list[str]], use_torchrun: bool, command_line: list[str] | None,
                debug: bool) -> int:
    """This node's part of the run: in this process, or this node's torchrun, supervised."""
    launch = plan.launch
    assert launch is not None
    if launch.node_rank == 0:
        write_launch_commands(plan.run_dir, command_line, commands, launch)
    if not use_torchrun:
        from shardtune.launch.worker import run_worker

        return run_worker(plan)
    if launch.master_port_given and launch.node_rank == 0:
        check_port_free(launch.master_addr, launch.master_port)
    # Every node agrees before a collective can hang (one node: no-op).
    check_nodes(launch, run_plan_dict(plan), plan.scheduler)
    write_run_plan(plan)
    gathers_parameters = spec_for(plan.engine.kind).gathers_parameters(plan.engine)
    started = time.time()
    stop_grace = plan.config.ddp_timeout + STOP_GRACE_MARGIN
    code = run_on_rank_server(launch, worker_argv(str(plan.run_dir / run_files.LAUNCH_PLAN), debug), plan.run_dir,
                              gathers_parameters, stop_grace)
    if code is None:
        code = run_torchrun(commands[launch.node_rank], launch, plan.run_dir, debug, gathers_parameters, stop_grace)
    if code == 0 and stopped_elsewhere(plan.run_dir, started):
        # Another node (a pod its scheduler deleted) asked the job to stop: every node's ranks saved and stopped,
        # and this node too must not report a finished run, or its scheduler would not requeue the job.
        print("[shardtune] the job was stopped from another node; exiting for a requeue", file=sys.stderr, flush=True)
        code = REQUEUE_EXIT_CODE
    if code not in (0, INTERRUPTED_EXIT_CODE, REQUEUE_EXIT_CODE) and launch.nnodes > 1:
        remedy = (f"check that {plan.scheduler} started one shardtune on each of the {launch.nnodes} nodes"
                  if plan.scheduler else f"start every node with NNODES={launch.nnodes}, "
                  f"MASTER_ADDR={launch.master_addr} and MASTER_PORT={launch.master_port}")
        print(f"shardtune: error: the job failed (exit code {code}); if the log shows a rendezvous timeout, a node "
              f"never joined: {remedy}", file=sys.stderr)
    return code


def stopped_elsewhere(run_dir: Path, since: float) -> bool:
    """Whether this attempt's ranks ended on a stop request (rank 0's last record: an interrupted end)."""
    from shardtune.train.rank_log import rank_log_path

    try:
        with open(rank_log_path(run_dir, 0), "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            last = handle.read().decode("utf-8", "replace").strip().splitlines()[-1]
        record = json.loads(last)
    except (OSError, IndexError, ValueError):
        return False
    return (isinstance(record, dict) and record.get("event") == "end" and record.get("interrupted") is True
            and float(record.get("time", 0)) >= since)


def write_launch_commands(run_dir: Path, command_line: list[str] | None, commands: list[list[str]],
                          launch: LaunchPlan) -> None:
    """What started this run, for the run's watchers: the user's command and each node's torchrun command."""
    path = run_dir / run_files.LAUNCH_COMMANDS
    record = {"cwd": os.getcwd(), "command_line": command_line, "nnodes": launch.nnodes,
              "nproc_per_node": launch.nproc_per_node, "master_addr": launch.master_addr,
              "master_port": launch.master_port, "started": time.time(), "launcher_pid": os.getpid(),
              "torchrun": [shlex.join(argv) for argv in commands]}
    with contextlib.suppress(OSError):  # watching is a convenience: a read-only output_dir fails later, clearly
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(path)


def check_port_free(addr: str, port: int) -> None:
    """Node 0 hosts the rendezvous: a taken MASTER_PORT would otherwise surface as a hang or a trace."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As torchrun's store binds: connections of a run that just ended (TIME_WAIT) do not make the port taken,
        # only a process listening on it does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("" if addr not in ("127.0.0.1", "localhost") else addr, port))
        except OSError:
            raise ConfigError(f"MASTER_PORT={port} is already in use on this machine; choose another port "
                              "or unset MASTER_PORT to pick a free one") from None


def omp_threads(nproc_per_node: int) -> str:
    """OMP_NUM_THREADS per rank: two ranks sharing a few cores slow each other down badly when each uses every
    core; the cores are this node's (or this Slurm task's) divided among its ranks."""
    return str(max(1, launch_env.node_cpus() // nproc_per_node))


def torchrun_env(env: dict[str, str], launch: LaunchPlan, gathers_parameters: bool, gpus: int) -> dict[str, str]:
    """torchrun's environment: ``env`` (this process's) with the settings shardtune adds where the user set none."""
    env.setdefault("OMP_NUM_THREADS", omp_threads(launch.nproc_per_node))
    if launch.master_addr in ("127.0.0.1", "localhost") and gpus == 0:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if gpus == 0 and gathers_parameters:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(GATHERING_MMAP_THRESHOLD))
    return env


# glibc's mmap threshold for CPU ranks of engines that gather parameters (FSDP, ZeRO-3). They keep their weights in
# host memory, and glibc's adaptive threshold keeps the freed multi-MB blocks of the layers they gather and free in
# its heap, so a sharded run's resident memory grew as large as a replicated one's (FSDP2 LoRA of a 217M model: 1.87
# GB -> 0.78 GB per rank with a fixed threshold). Below the threshold, blocks come from the heap, which only shrinks
# from its top: at 128 KiB the small tensors of a LoRA run (64 KiB adapter matrices, their gradients and partitions)
# fragmented it, and it grew by 50-67 MiB over 3 steps of the 206M ZeRO-3 LoRA run (8 MiB at 16 KiB), run to run
# differently (benchmarks/gather_mmap_threshold_cpu.py; docs/estimate.md, "Measured: ZeRO-3 LoRA"). Engines that
# gather nothing keep the adaptive threshold: a fixed one maps every activation above it afresh each step (DDP LoRA
# of benchmarks/llamafactory_cpu.py, 120 steps: 1.35 million minor page faults against 0.28 million, and a 1.33x
# slower loop: benchmarks/mmap_threshold_cpu.py).
GATHERING_MMAP_THRESHOLD = 64 * 1024


# After a stop request, a rank has until its collectives time out (ddp_timeout) and this margin to finish its step
# and save; a rank still running then is stuck, and the whole job is killed.
STOP_GRACE_MARGIN = 60


def run_torchrun(argv: list[str], launch: LaunchPlan, run_dir: Path, debug: bool = False,
                 gathers_parameters: bool = False, stop_grace: float = 1800 + STOP_GRACE_MARGIN) -> int:
    """Run torchrun for this node; unless ``debug``, a failed rank ends up as one line, not three tracebacks.
    ``gathers_parameters``: the engine gathers and frees layers (FSDP, ZeRO-3), which sets glibc's mmap threshold
    on CPU ranks."""
    env = torchrun_env(dict(os.environ), launch, gathers_parameters, visible_gpu_count())
    adopt_orphans()
    print(f"[shardtune] launching: {shlex.join(argv)}", flush=True)
    if debug:
        return wait_for_launcher(subprocess.Popen(argv, env=env, start_new_session=True), stop_grace)
    started = time.time()
    output = LauncherOutput()
    # Only stderr is filtered (torchrun's account of a failure goes there); stdout stays the terminal's.
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    reader = threading.Thread(target=pump, args=(proc.stderr.fileno(), output, sys.stderr), daemon=True)
    reader.start()
    code = wait_for_launcher(proc, stop_grace)
    # A rank's own child processes can hold the pipe open after torchrun ended: do not wait on them for long.
    reader.join(timeout=5)
    if not reader.is_alive():
        proc.stderr.close()
    return report_launch_failure(code, output, run_dir, started)


def run_on_rank_server(launch: LaunchPlan, worker: list[str], run_dir: Path, gathers_parameters: bool,
                       stop_grace: float) -> int | None:
    """This node's ranks forked by the rank server SHARDTUNE_RANK_SERVER names (launch/rank_server.py), watched and
    reported as torchrun's are; None when there is no server or it cannot serve this launch (then torchrun)."""
    from shardtune.launch import served

    address = served.server_address(os.environ)
    if address is None or launch.nnodes != 1 or launch.is_elastic or launch.c10d_rendezvous:
        return None
    env = torchrun_env(dict(os.environ), launch, gathers_parameters, visible_gpu_count())
    envs = served.rank_environments(env, launch.nproc_per_node, launch.master_addr, launch.master_port,
                                    run_id=f"served-{os.getpid()}-{time.time_ns()}")
    output = LauncherOutput()
    read_end, write_end = os.pipe()
    reader = threading.Thread(target=pump, args=(read_end, output, sys.stderr), daemon=True)
    reader.start()
    group = served.RankGroup()
    received = served.stop_on_signals(group, stop_grace)
    started = time.time()
    try:
        codes = served.run_served_ranks(address, envs, worker, os.getcwd(), (0, 1, write_end), group)
    except served.ServerRefused as why:
        print(f"[shardtune] the rank server cannot start these ranks ({why}); launching with torchrun", flush=True)
        return None
    finally:
        os.close(write_end)
        reader.join(timeout=5)
    print(f"[shardtune] ran {len(codes)} ranks on the rank server {address}", flush=True)
    for rank in group.ranks:
        if rank.left_running:
            print(f"{served.LEFT_RUNNING} {rank.left_running}", file=sys.stderr, flush=True)
    if received:
        import signal

        return exit_code_for(signal.Signals(received[0]).name)
    failed = sorted((i for i, c in enumerate(codes) if c != 0), key=lambda i: codes[i] == -15)
    output.add_failures([RankExit(rank, codes[rank]) for rank in failed])
    return report_launch_failure(1 if failed else 0, output, run_dir, started)


def report_launch_failure(code: int, output: LauncherOutput, run_dir: Path, started: float) -> int:
    """One line when no rank could say why it failed (killed, for instance); exit code 2 for bad input."""
    failed = output.failed_ranks()
    if code in (0, INTERRUPTED_EXIT_CODE, REQUEUE_EXIT_CODE) or not failed:
        return code
    if not output.any_rank_reported:
        # torchrun stops the other ranks with SIGTERM: the cause is the first failure that is not one of those.
        cause = next((f for f in failed if not f.stopped_by_torchrun), failed[0])
        # A rank NCCL's watchdog took down (SIGABRT) raised nothing in Python: its log says why.
        watchdog = output.watchdog_report(cause) if cause.aborted else None
        print(saved_failure_report(run_dir, cause.rank, started) or watchdog or f"shardtune: error: {cause.describe()}",
              file=sys.stderr, flush=True)
    return 2 if any(f.exit_code == 2 for f in failed) else code


def wait_for_launcher(proc: subprocess.Popen, stop_grace: float = 1800 + STOP_GRACE_MARGIN) -> int:
    """Wait for torchrun; Ctrl-C / SIGTERM reach the ranks directly so they finish the step and save.

    torchrun runs in its own session so the terminal's Ctrl-C does not hit it: torchrun treats a signal as a
    failure (a traceback, ranks killed). Ranks that stop on request exit 0; this process then exits 130 after
    Ctrl-C, or asks a scheduler to requeue it after SIGTERM / SIGUSR1 (launch/preemption.py). Every wait
    is bounded: ranks that have not stopped ``stop_grace`` seconds after the request (a rank stuck in a collective)
    are killed with the whole job, at once on a second request; torchrun still in its rendezvous (no ranks yet) is
    stopped itself. Whatever of the job's session is left when torchrun ends is killed (no process left behind);
    torchrun itself dies with this process (launch/torchrun_agent.py).
    """
    import signal

    interrupted: list[int] = []

    def stop_ranks(signum, frame) -> None:
        interrupted.append(signum)
        if len(interrupted) > 1:
            kill_job(proc, "a second stop request")
            return
        print(STOP_NOTICE, file=sys.stderr, flush=True)
        for pid in child_pids(proc.pid) or [proc.pid]:  # no ranks yet: torchrun is still in its rendezvous
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        threading.Thread(target=kill_after, args=(proc, stop_grace), daemon=True).start()

    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, stop_ranks)
    try:
        code = proc.wait()
    finally:
        kill_session(proc.pid)
    if interrupted:
        return exit_code_for(signal.Signals(interrupted[0]).name)
    return code if code >= 0 else 128 - code


def kill_after(proc: subprocess.Popen, seconds: float) -> None:
    """The stop request's bound: the job still running ``seconds`` later is killed."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        kill_job(proc, f"{seconds:.0f} s after the stop request (ddp_timeout + {STOP_GRACE_MARGIN} s)")


def kill_job(proc: subprocess.Popen, why: str) -> None:
    print(f"shardtune: error: the ranks did not stop ({why}; a rank stuck in a collective?): killing the job; the "
          "latest complete checkpoint stays the one to resume from", file=sys.stderr, flush=True)
    kill_session(proc.pid)


def kill_session(session: int) -> None:
    """SIGKILL torchrun and every process below it: its ranks (each in a process group of its own) and theirs;
    then whatever of the job was handed to this process (a subreaper, see ``adopt_orphans``) after its parent
    died, reaped so that none is left as a zombie. This process's other children are not the job's: only a child
    in the job's session (torchrun's, which its ranks and theirs keep) counts as adopted (a process that embeds
    the launcher, a test session with its rank server, has children of its own started at any time)."""
    import signal

    adopted = [pid for pid in child_pids(os.getpid())
               if pid not in _OWN_CHILDREN and pid != session and session_of(pid) == session]
    orphans = [p for pid in adopted for p in (pid, *descendants(pid))]
    for pid in [session, *descendants(session), *orphans]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in adopted:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # ended meanwhile
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (children before their own children)."""
    found: list[int] = []
    frontier = [pid]
    while frontier:
        children = child_pids(frontier.pop())
        found += children
        frontier += children
    return found


_OWN_CHILDREN: set[int] = set()  # this process's children from before torchrun: not the job's


def adopt_orphans() -> None:
    """Make this process the subreaper of what it starts: a rank's child whose rank died is handed to this
    process instead of init, so that the end of the run can find and stop it (Linux; elsewhere nothing)."""
    import ctypes

    _OWN_CHILDREN.update(child_pids(os.getpid()))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


PR_SET_CHILD_SUBREAPER = 36


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (torchrun's ranks), from /proc."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return children
