"""Multi-node runs on one machine in tests: ports for them, and starting the nodes together.

A multi-node `shardtune train` uses MASTER_PORT for torchrun's rendezvous and MASTER_PORT + 1 for its node check
(launch/nodes.py). A port from ``bind(0)`` is in the kernel's ephemeral range, where any outgoing connection of a
parallel test may take the next one: node 0 then cannot host the check and stops while the other node waits for
it until RDZV_TIMEOUT (seen once in a `make test`, 2026-11-30). So the ports here come from below that range,
where only an explicit bind takes a port, with the next one free too.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

LOW, HIGH = 20000, 32000  # below Linux's default ephemeral range (32768-60999)


def free_port_pair() -> int:
    """A port P below the ephemeral range such that P and P + 1 are both free now."""
    chooser = random.Random()
    for _ in range(200):
        port = chooser.randrange(LOW, HIGH)
        if all(_bindable(p) for p in (port, port + 1)):
            return port
    raise RuntimeError(f"no two adjacent free ports found in {LOW}-{HIGH}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_nodes(argvs: list[list[str]], envs: list[dict[str, str]], folder: Path, timeout: float,
              **popen: Any) -> list[tuple[int, str, str]]:
    """Start one process per node, wait for all of them, and return (exit code, stdout, stderr) per node.

    A node that fails stops the others at once (they would wait for it until RDZV_TIMEOUT), and so does the
    timeout; no process of any node is left running either way (each node is a process group, killed whole).
    Output goes to files, so a chatty node never blocks on a pipe."""
    folder.mkdir(parents=True, exist_ok=True)
    outs = [(open(folder / f"node{i}.out", "w+"), open(folder / f"node{i}.err", "w+"))  # noqa: SIM115
            for i in range(len(argvs))]
    procs = [subprocess.Popen(argv, env=env, stdout=out, stderr=err, text=True, start_new_session=True, **popen)
             for argv, env, (out, err) in zip(argvs, envs, outs, strict=True)]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:  # each node's whole process group: its torchrun and ranks too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    results = []
    for proc, (out, err) in zip(procs, outs, strict=True):
        out.seek(0)
        err.seek(0)
        results.append((proc.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results
