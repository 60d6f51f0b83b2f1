"""Node 0's MASTER_PORT check: a listening process makes the port taken; a run that just ended on it does not."""

from __future__ import annotations

import datetime
import shutil
import socket
import subprocess
import time

import pytest
from torch.distributed import TCPStore

from shardtune.errors import ConfigError
from shardtune.launch.supervise import check_port_free
from shardtune.launch.torchrun import find_free_port


def test_a_listening_port_is_refused_with_the_remedy():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(ConfigError, match=f"MASTER_PORT={port} is already in use"):
            check_port_free("127.0.0.1", port)


def test_a_port_whose_last_run_just_ended_is_free():
    """A run's rendezvous store closes its connections when the run ends; they stay in TIME_WAIT on MASTER_PORT
    for a minute, and the next run on the same port must still start (torchrun's store binds with SO_REUSEADDR).
    Seen when two multi-node tests ran back to back on MASTER_PORT 29400."""
    if shutil.which("ss") is None:
        pytest.skip("needs `ss` (iproute2) to see the connection states")
    port = find_free_port()
    timeout = datetime.timedelta(seconds=10)
    store = TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
    client = TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
    client.set("rank1", "done")
    assert store.get("rank1") == b"done"
    del store  # the server ends first, as node 0's store does
    time.sleep(0.3)
    del client
    time.sleep(0.3)
    states = subprocess.run(["ss", "-tan", f"sport = :{port}"], capture_output=True, text=True).stdout
    if "TIME-WAIT" not in states:
        pytest.skip(f"no connection left in TIME_WAIT on port {port} here ({states.strip()!r})")
    check_port_free("127.0.0.1", port)
