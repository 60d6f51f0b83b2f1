"""tests/nodes.py: the ports multi-node tests use, and a failing node that stops the others at once."""

from __future__ import annotations

import os
import socket
import sys
import time

from tests.nodes import HIGH, LOW, free_port_pair, run_nodes

# A node whose own child outlives it unless its whole process group is killed.
WAITS_WITH_A_CHILD = ("import subprocess, sys, time; "
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                      "print(child.pid, flush=True); time.sleep(120)")


def test_port_pair_is_below_the_ephemeral_range_and_both_bind():
    port = free_port_pair()
    assert LOW <= port < HIGH
    for taken in (port, port + 1):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", taken))


def test_a_failing_node_stops_the_other_and_its_children_at_once(tmp_path):
    started = time.monotonic()
    nodes = run_nodes([[sys.executable, "-c", WAITS_WITH_A_CHILD],
                       [sys.executable, "-c", "import sys, time; time.sleep(1); sys.exit(3)"]],
                      [dict(os.environ)] * 2, tmp_path, timeout=60)
    assert time.monotonic() - started < 30
    assert [code for code, _, _ in nodes] == [-9, 3]
    child = int(nodes[0][1].split()[0])
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for init to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
