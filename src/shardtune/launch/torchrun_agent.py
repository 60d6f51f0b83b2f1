"""torchrun itself (``torch.distributed.run.main``, every argument as torchrun reads it), ending without the
interpreter's final garbage collection.

The agent has torch's whole import graph loaded, and a normal interpreter exit collects it: 0.3 s on this CPU after
the last rank has exited, on every run (measured: a process that imported torch exits in 0.41 s, 0.10 s with its
objects frozen first). ``gc.freeze`` moves every object out of the collector's reach, so the teardown frees memory
without scanning it; the import of torch runs with the collector off, for the same reason. Nothing else changes:
torchrun's arguments, its exit code, its failure report on stderr.

    python -m shardtune.launch.torchrun_agent --nproc-per-node=2 ... -m shardtune.train PLAN
"""

from __future__ import annotations

import contextlib
import gc


def die_with_parent(signum: int | None = None) -> None:
    """Receive ``signum`` (SIGTERM by default) when the parent dies. torchrun runs in its own session (the terminal's
    Ctrl-C must not reach it): without this, a launcher killed outright (SIGKILL, a scheduler's time limit) would
    leave torchrun and its ranks running. Linux sends SIGTERM at the parent's death, and torchrun stops its ranks on
    SIGTERM. The rank server (launch/rank_server.py) uses it for the processes it forks."""
    import ctypes
    import os
    import signal

    signum = int(signal.SIGTERM if signum is None else signum)
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signum)


PR_SET_PDEATHSIG = 1


def main() -> None:
    die_with_parent()
    gc.disable()  # importing torch allocates for the whole run: nothing for the collector to find (startup_gc.py)
    from torch.distributed.run import main as torchrun_main

    gc.freeze()
    gc.enable()
    try:
        torchrun_main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    main()
