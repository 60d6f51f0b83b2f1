"""USE_RAY=1 on a real Ray cluster of two hosts: a Ray head (`ray start --head`) in one network namespace and a
Ray worker node (`ray start --address`) in the other (scripts/netns_pair.sh: 10.77.0.1 node1, 10.77.0.2 node2),
one CPU each; the driver joins the cluster by address and STRICT_SPREAD puts one rank on each host."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env
from tests.distributed.helpers import losses
from tests.distributed.test_nodes_netns import ADDRESSES, SCRIPT, pair, training_args  # noqa: F401 - a fixture

pytestmark = [pytest.mark.distributed, pytest.mark.matrix, pytest.mark.timeout(600)]
GCS_PORT = 6391  # inside the pair's own namespaces: no other Ray instance listens there
RAY = str(Path(sys.executable).with_name("ray"))
# Ray 2.60 clusters use token authentication: this cluster's own token (not the one Ray keeps in ~/.ray).
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}


def in_namespace(host: tuple[str, str, str], argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
    suffix, side, _ = host
    return subprocess.Popen(["bash", str(SCRIPT), "run", suffix, side, *argv], cwd=REPO, env=env, text=True,
                            **kwargs)


def our_processes(root: Path) -> list[int]:
    """The Ray processes of this test's cluster: every Ray process names its node's temp dir (under ``root``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(root) in cmdline:
            found.append(int(entry.name))
    return found


def stop_cluster(starters: list[subprocess.Popen], root: Path) -> list[int]:
    """SIGTERM (Ray's graceful stop) to the cluster's processes, SIGKILL what is left after 10 s; the pids that
    still run after that (none expected). `ray stop` is not used: it stops every Ray process on the machine."""
    for pid in our_processes(root) + [s.pid for s in starters]:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while our_processes(root) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in our_processes(root):
        _signal(pid, signal.SIGKILL)
    for starter in starters:
        starter.wait(timeout=30)
    time.sleep(1)
    return our_processes(root)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def alive_nodes(host: tuple[str, str, str], env: dict[str, str]) -> int:
    status = in_namespace(host, [RAY, "status", "--address", f"{ADDRESSES[0]}:{GCS_PORT}"], env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = status.communicate(timeout=60)
    active = out.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in out else ""
    time.sleep(1)
    return len(re.findall(r"^\s*1 node_", active, re.M))


def start_node(host: tuple[str, str, str], root: Path, log: Path, *role: str) -> subprocess.Popen:
    """`ray start --block` on ``host``: this node's Ray processes, with their output in ``log``. Its own raylet
    environment carries GLOO_SOCKET_IFNAME (this host's end of the veth) to every Ray worker it starts."""
    env = cli_env(GLOO_SOCKET_IFNAME=host[2], PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}", **AUTH)
    argv = [RAY, "start", *role, "--temp-dir", str(root / host[1]), "--num-cpus", "1", "--disable-usage-stats",
            "--block"]
    with log.open("w") as sink:
        return in_namespace(host, argv, env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_nodes(count: int, starter: subprocess.Popen, host: tuple[str, str, str], log: Path) -> None:
    deadline = time.monotonic() + 120
    while alive_nodes(host, cli_env(**AUTH)) < count:
        assert starter.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]


@pytest.fixture
def ray_cluster(pair, tmp_path) -> Iterator[Path]:  # noqa: F811 - pair is the imported fixture
    """A Ray head on node1 and a Ray worker node on node2, one CPU each. Yields the root of the nodes' temp dirs
    (short: Ray's unix sockets live under it)."""
    root = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))
    started = time.monotonic()
    head = ["--head", "--node-ip-address", ADDRESSES[0], "--port", str(GCS_PORT), "--include-dashboard", "false"]
    starters = [start_node(pair[0], root, tmp_path / "ray-node1.log", *head)]
    try:
        wait_for_nodes(1, starters[0], pair[0], tmp_path / "ray-node1.log")
        worker = ["--address", f"{ADDRESSES[0]}:{GCS_PORT}", "--node-ip-address", ADDRESSES[1]]
        starters.append(start_node(pair[1], root, tmp_path / "ray-node2.log", *worker))
        wait_for_nodes(2, starters[1], pair[0], tmp_path / "ray-node2.log")
        print(f"Ray cluster of 2 nodes up in {time.monotonic() - started:.1f} s")
        yield root
    finally:
        left = stop_cluster(starters, root)
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"Ray processes still running after the test: {left}"


def test_ray_cluster_of_two_namespaces_trains_like_one_process(pair, ray_cluster, reference,  # noqa: F811
                                                                  tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = [*training_args(tiny_model_dir, out), "ray_num_workers=2", "resources_per_worker={'CPU': 1}",
            "placement_strategy=STRICT_SPREAD", f"ray_init_kwargs={{'address': '{ADDRESSES[0]}:{GCS_PORT}'}}",
            f"ray_storage_path={tmp_path / 'ray_state'}"]
    started = time.monotonic()
    driver = in_namespace(pair[0], [sys.executable, "-m", "shardtune", *args], cli_env(USE_RAY="1", **AUTH),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output, _ = driver.communicate(timeout=500)
    print(f"driver ran {time.monotonic() - started:.1f} s")
    assert driver.returncode == 0, output[-6000:]
    assert "Ray Train TorchTrainer: 2 workers x {CPU: 1} (gloo), placement STRICT_SPREAD" in output
    assert losses(out) == pytest.approx(reference["full"], rel=2e-3)
    # Ray Train's controller logs where it placed each rank (in its worker's log on its node, and on the driver).
    # Which host gets rank 0 is Ray's choice (MASTER_ADDR follows it): each host must run one rank.
    logs = output + "".join(p.read_text(errors="replace") for p in ray_cluster.glob("*/session_*/logs/worker-*"))
    placed = {rank: ip for ip, rank in re.findall(r"\(ip=(10\.77\.0\.\d), pid=\d+\) world_rank=(\d)", logs)}
    print(f"ranks placed on {placed}")
    assert sorted(placed) == ["0", "1"] and sorted(placed.values()) == list(ADDRESSES), output[-4000:]
