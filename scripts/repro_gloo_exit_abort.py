"""Reproduce the gloo exit abort: 2 processes join a gloo group, all-reduce, exit; count the SIGABRTs.

    python scripts/repro_gloo_exit_abort.py --runs 30                      # as a shardtune rank ended before
    python scripts/repro_gloo_exit_abort.py --runs 30 --exit leave_rank    # shardtune's rank exit now
    python scripts/repro_gloo_exit_abort.py --runs 30 --end late_release   # the race made certain

Each rank all-reduces a tensor made in Python (so the tensor has a Python object), then ends like a
shardtune rank did: barrier, destroy_process_group() while something still holds the group object (FSDP2's
mesh does; see --release-group), and a normal interpreter exit. gloo's worker threads then outlive the start
of interpreter shutdown; when one of them drops the last C++ reference to such a tensor it must take the GIL,
CPython ends a thread that asks for the GIL after finalization began (pthread_exit), and that forced unwind
through the noexcept ~AsyncWork destructor calls std::terminate: "terminate called without an active
exception", SIGABRT. It needs the worker to be late, so it is rare (2 runs in 30 on a loaded 2-core machine);
``--end late_release`` holds one release until exit begins (about 4 runs in 5 abort). ``--exit leave_rank``
ends the rank with shardtune.launch.worker.leave_rank (exit handlers, flush, os._exit), which never starts
interpreter shutdown; apart from that call the worker uses no shardtune code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

WORKER = r"""
import atexit, os, sys, threading, time, weakref

# Registered before torch is imported, so that it runs last of the exit handlers, just before shutdown.
exit_begun = threading.Event()
atexit.register(exit_begun.set)

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
# FSDP2 keeps the group object in its state; destroy_process_group() then cannot join gloo's threads.
held = dist.group.WORLD if os.environ["REPRO_HOLD"] == "1" else None
value = torch.ones(64)
for _ in range(int(os.environ["REPRO_STEPS"])):
    dist.all_reduce(value)
if os.environ["REPRO_END"] == "late_release":
    # The race made certain: gloo's worker thread owns the last reference to a tensor made in Python and
    # releases it only once interpreter shutdown has begun.
    released = threading.Event()

    def release_at_exit():
        released.set()
        exit_begun.wait(30)

    late = torch.ones(64)
    weakref.finalize(late, release_at_exit)
    dist.all_reduce(late, async_op=True)  # the handle is dropped: the worker's reference is the last
    del late
    released.wait(60)
    # Meet on the store (gloo's queue stays locked while its worker waits); rank 0 hosts it, so leaves last.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"done{rank}", "1")
    store.wait(["done0", "done1"])
    if rank == 0:
        store.wait(["left1"])
    else:
        store.set("left1", "1")
elif os.environ["REPRO_END"] == "barrier":
    dist.barrier()
    dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
if os.environ["REPRO_EXIT"] == "leave_rank":
    from shardtune.launch.worker import leave_rank

    leave_rank(0)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(rank: int, port: int, args: argparse.Namespace) -> dict[str, str]:
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
                REPRO_EXIT=args.exit_mode, REPRO_END=args.end, REPRO_STEPS=str(args.steps),
                REPRO_HOLD="0" if args.release_group else "1")


def run_pair(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """Start ranks 0 and 1 (env:// rendezvous on a TCPStore that rank 0 hosts); their exit codes and stderr."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=worker_env(rank, port, args),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    codes, errors = [], []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        codes.append(proc.returncode)
        errors.append(err)
    return codes, errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--exit", choices=["normal", "leave_rank"], default="normal", dest="exit_mode",
                        help="normal: let the interpreter shut down; leave_rank: shardtune's rank exit")
    parser.add_argument("--end", choices=["barrier", "all_reduce", "late_release"], default="barrier",
                        help="barrier: barrier + destroy_process_group() after the last all-reduce, as "
                             "shardtune's engines close; all_reduce: exit right after it; late_release: gloo's "
                             "worker releases one more tensor only once exit begins")
    parser.add_argument("--release-group", action="store_true",
                        help="hold no reference to the group, so destroy_process_group() joins gloo's threads")
    parser.add_argument("--steps", type=int, default=20, help="all-reduces per rank")
    parser.add_argument("--timeout", type=float, default=120.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    aborted = failed = 0
    started = time.time()
    for run in range(args.runs):
        codes, errors = run_pair(args)
        aborts = sum(c == -signal.SIGABRT for c in codes)
        aborted += aborts > 0
        failed += any(c != 0 for c in codes)
        print(f"run {run + 1:3d}: exit codes {codes}{'  <- SIGABRT' if aborts else ''}", flush=True)
        for code, err in zip(codes, errors, strict=True):
            if code != 0 and err.strip():
                print(f"    {err.strip().splitlines()[-1]}", flush=True)
    print(f"exit={args.exit_mode} end={args.end} group={'released' if args.release_group else 'held'}: "
          f"{aborted}/{args.runs} runs had a SIGABRT ({100 * aborted / max(args.runs, 1):.0f}%), {failed} with a "
          f"non-zero exit; {time.time() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
