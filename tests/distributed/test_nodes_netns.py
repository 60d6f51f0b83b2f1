"""Two hosts on one machine: each node runs in its own network namespace (scripts/netns_pair.sh), joined by a veth
pair, 10.77.0.1 (node 0, host name node1) and 10.77.0.2 (node2); MASTER_ADDR is node 0's address on the veth."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, overrides_merged
from tests.distributed.helpers import COMMON, losses

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
SCRIPT = REPO / "scripts" / "netns_pair.sh"
ADDRESSES = ("10.77.0.1", "10.77.0.2")


def netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is not available here"
    return None


@pytest.fixture(scope="module")
def pair():
    """(suffix, side, veth) of node 0 and node 1; removed afterwards."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    suffix = f"p{os.getpid() % 10**6}"
    created = subprocess.run(["bash", str(SCRIPT), "up", suffix], capture_output=True, text=True)
    if created.returncode != 0:
        pytest.skip(f"cannot create network namespaces: {created.stderr.strip()}")
    yield [(suffix, "a", f"v{suffix}a"), (suffix, "b", f"v{suffix}b")]
    subprocess.run(["bash", str(SCRIPT), "down", suffix], check=True)


class Node:
    """One node's `shardtune` process in its namespace; notes when its node check started."""

    def __init__(self, host: tuple[str, str, str], args: list[str], env: dict[str, str],
                 prefix: tuple[str, ...] = ()) -> None:
        self.check_started: float | None = None
        suffix, side, _ = host
        self.proc = subprocess.Popen(["bash", str(SCRIPT), "run", suffix, side, *prefix, sys.executable, "-m",
                                      "shardtune", *args],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            if self.check_started is None and line.startswith("[shardtune] node check: node"):
                self.check_started = time.monotonic()
            lines.append(line)

    def finish(self, timeout: float = 500) -> tuple[int, str, str, float]:
        """Exit code, stdout, stderr and the time it ended."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # The whole session: a node left running would hold the next test's ports.
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        ended = time.monotonic()
        for reader in self.readers:
            reader.join(timeout=5)
        return code, "".join(self.out), "".join(self.err), ended


def start_nodes(pair, args: list[str], per_node_env: list[dict[str, str]], **common: str) -> list[Node]:
    return [Node(host, args, cli_env(GLOO_SOCKET_IFNAME=host[2], RDZV_TIMEOUT="120", **common, **per_node_env[i]))
            for i, host in enumerate(pair)]


def static_env(rank: int) -> dict[str, str]:
    return {"NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": ADDRESSES[0], "MASTER_PORT": "29400",
            "NPROC_PER_NODE": "1"}


def slurm_env(rank: int, job_id: str) -> dict[str, str]:
    """What srun sets for one task per node on two nodes, node1 and node2 (each namespace's host name, resolved
    by both: torchrun's c10d rendezvous finds the host that serves it by its name)."""
    return {"SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2",
            "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_NODEID": str(rank), "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURMD_NODENAME": f"node{rank + 1}",
            "NPROC_PER_NODE": "1"}


def training_args(model: Path, out: Path) -> list[str]:
    return ["train", *COMMON, f"model_name_or_path={model}", f"output_dir={out}", "finetuning_type=full",
            "per_device_train_batch_size=2"]


@pytest.mark.parametrize("launch", ["torchrun", "slurm"])
def test_two_namespaces_train_like_one_process(launch, pair, reference, tiny_model_dir, tmp_path):
    envs = [static_env(r) if launch == "torchrun" else slurm_env(r, f"{os.getpid()}7") for r in (0, 1)]
    nodes = start_nodes(pair, training_args(tiny_model_dir, tmp_path), envs)
    results = [n.finish() for n in nodes]
    assert [r[0] for r in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    assert "[shardtune] node check: 2 nodes agree" in results[0][1]
    assert losses(tmp_path) == pytest.approx(reference["full"], rel=2e-3)
    if launch == "slurm":
        assert "--rdzv-backend=c10d" in results[1][1] and "--rdzv-endpoint=node1:" in results[1][1]


def edited_copy(tmp_path: Path) -> Path:
    """shardtune's source with another __version__: what a node with another install runs."""
    src = tmp_path / "other-src"
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    init = src / "shardtune" / "__init__.py"
    init.write_text(re.sub(r'__version__ = "([^"]+)"', r'__version__ = "\1.dev9"', init.read_text()))
    return src


@pytest.mark.parametrize("difference", ["config", "version"])
def test_a_node_that_differs_stops_both_nodes_with_one_line(difference, pair, tiny_model_dir, tmp_path):
    args = training_args(tiny_model_dir, tmp_path / "out")
    other = ({"PYTHONPATH": f"{edited_copy(tmp_path)}{os.pathsep}{REPO}"} if difference == "version" else {})
    nodes = [Node(pair[0], args, cli_env(GLOO_SOCKET_IFNAME=pair[0][2], **static_env(0))),
             Node(pair[1], overrides_merged(args + (["learning_rate=2e-3"] if difference == "config" else [])),
                  cli_env(GLOO_SOCKET_IFNAME=pair[1][2], **static_env(1), **other))]
    results = [n.finish(timeout=300) for n in nodes]
    expected = ("in config key learning_rate: 0.001 on node 0, 0.002 on node 1" if difference == "config"
                else "in shardtune: 0.1.0 on node 0, 0.1.0.dev9 on node 1")
    for code, _, err, _ in results:
        errors = [x for x in err.splitlines() if x.startswith("shardtune: error:")]
        assert code == 2 and len(errors) == 1 and "node 1 (node2)" in errors[0] and expected in errors[0], err[-3000:]
        assert "launching:" not in results[0][1]  # stopped before torchrun
    both_checking = max(n.check_started or 0 for n in nodes)
    stopped = max(r[3] for r in results) - both_checking
    print(f"stopped {stopped:.1f} s after both nodes began the check")
    assert stopped < 30


def test_doctor_prints_its_tables_for_two_namespaces(pair, tmp_path):
    envs = [{k: v for k, v in static_env(r).items() if k != "NPROC_PER_NODE"} for r in (0, 1)]
    nodes = start_nodes(pair, ["doctor", "--iterations", "3"], envs)
    results = [n.finish(timeout=300) for n in nodes]
    assert [r[0] for r in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    table = results[0][1]
    print(table)
    assert re.search(r"host\s+node1\s+node2", table)
    assert re.search(rf"interface\s+{pair[0][2]}\s+{pair[1][2]}", table)
    assert re.search(r"address\s+10\.77\.0\.1\s+10\.77\.0\.2", table)
    assert re.search(r"reaches_master\s+is the master\s+yes \(", table)
    assert "all-reduce, gloo, 2 nodes x 1 process" in table
    assert len(re.findall(r"^(4 KiB|1 MiB|16 MiB|64 MiB)\s+\d+\.\d+ ms\s+\d+\.\d+ GB/s", table, re.M)) == 4


def saving_args(model: Path, out: Path) -> list[str]:
    """training_args with a checkpoint every 2 steps (each key once on the command line)."""
    return [a for a in training_args(model, out) if not a.startswith("save_strategy=")] + [
        "save_strategy=steps", "save_steps=2"]


def own_tmpfs(folder: Path) -> tuple[str, ...]:
    """A command prefix that mounts a tmpfs over ``folder`` in the node's own mount namespace (`ip netns exec`
    gives each node one): that node's output_dir is then a folder of its own, as a pod's disk is."""
    return ("sh", "-c", 'mkdir -p "$0" && mount -t tmpfs tmpfs "$0" && exec "$@"', str(folder))


def test_a_node_with_its_own_output_dir_is_refused_before_launch(pair, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = saving_args(tiny_model_dir, out)
    nodes = [Node(pair[0], args, cli_env(GLOO_SOCKET_IFNAME=pair[0][2], **static_env(0))),
             Node(pair[1], args, cli_env(GLOO_SOCKET_IFNAME=pair[1][2], **static_env(1)), prefix=own_tmpfs(out))]
    results = [n.finish(timeout=300) for n in nodes]
    for code, stdout, err, _ in results:
        errors = [x for x in err.splitlines() if x.startswith("shardtune: error:")]
        assert code == 2 and len(errors) == 1, err[-3000:]
        assert f"node 1 (node2) does not share output_dir {out} with node 0 (node1)" in errors[0]
        assert "launching:" not in stdout  # stopped before torchrun
    assert not list(out.glob("checkpoint-*"))


def test_ranks_without_the_node_check_refuse_an_unshared_output_dir(pair, tiny_model_dir, tmp_path):
    """An elastic node range skips the node check (how many nodes come is not known before): the ranks check
    output_dir themselves before the first step, all together, instead of crashing at the first checkpoint."""
    out = tmp_path / "out"
    args = saving_args(tiny_model_dir, out)
    elastic = {"MIN_NNODES": "1", "MAX_NNODES": "2", "RDZV_ID": f"shared{os.getpid()}"}
    nodes = [Node(pair[0], args, cli_env(GLOO_SOCKET_IFNAME=pair[0][2], **static_env(0), **elastic)),
             Node(pair[1], args, cli_env(GLOO_SOCKET_IFNAME=pair[1][2], **static_env(1), **elastic),
                  prefix=own_tmpfs(out))]
    results = [n.finish(timeout=400) for n in nodes]
    assert [r[0] for r in results] == [2, 2], results[0][2][-3000:] + results[1][2][-3000:]
    text = results[0][2] + results[1][2]
    assert f"output_dir {out} is not shared by every rank: 1 of 2 ranks cannot see the file rank 0 wrote" in text
    assert "node check" not in results[0][1]
    assert not list(out.glob("checkpoint-*"))
