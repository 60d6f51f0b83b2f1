"""The node check: the comparison of node reports (pure), its messages, and the exchange over a real TCPStore
between threads (no processes)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from shardtune.errors import ConfigError
from shardtune.launch import nodes
from shardtune.launch.env import node_cpus, socket_ifname
from shardtune.launch.torchrun import LaunchPlan, find_free_port


def report(node: int, **changes) -> dict:
    base = {"node": node, "host": f"host{node}", "python": "3.11.7", "torch": "2.13.0", "cuda": "12.8",
            "nccl": "2.27.3", "transformers": "5.23.0", "deepspeed": "0.19.8", "peft": "0.21.2",
            "shardtune": "0.1.0", "code_hash": "abc", "device_count": 8, "nproc_per_node": 8,
            "device_model": "NVIDIA H100", "free_device_memory": "79.0 GiB", "free_host_memory": "900.0 GiB",
            "interface": "eth0", "address": f"10.0.0.{node + 1}", "reaches_master": "yes", "config_hash": "c1",
            "config": {"learning_rate": 1e-3, "seed": 42}, "problems": []}
    return {**base, **changes}


def test_equal_nodes_have_no_problem_even_with_other_free_memory():
    problems, warnings = nodes.compare_reports([report(0), report(1, free_device_memory="3.0 GiB",
                                                                   free_host_memory="1.0 GiB", interface="ib0")])
    assert (problems, warnings) == ([], [])


@pytest.mark.parametrize("field, theirs", [("transformers", "5.22.0"), ("python", "3.10.14"), ("device_count", 4),
                                           ("code_hash", "def"), ("nccl", "2.21.5"), ("shardtune", "0.2.0")])
def test_a_difference_names_the_node_the_field_and_both_values(field, theirs):
    problems, _ = nodes.compare_reports([report(0), report(1), report(2, **{field: theirs})])
    assert len(problems) == 1
    assert problems[0].startswith(f"node 2 (host2) differs from node 0 (host0) in {field}: ")
    assert f"{report(0)[field]} on node 0, {theirs} on node 2" in problems[0]


def test_a_config_difference_names_the_key():
    other = report(1, config_hash="c2", config={"learning_rate": 2e-3, "seed": 42})
    problems, _ = nodes.compare_reports([report(0), other])
    assert problems == ["node 1 (host1) differs from node 0 (host0) in config key learning_rate: 0.001 on node 0, "
                        "0.002 on node 1; start every node with the same config and key=value overrides"]


def test_another_gpu_model_warns_but_runs():
    problems, warnings = nodes.compare_reports([report(0), report(1, device_model="NVIDIA A100")])
    assert problems == [] and len(warnings) == 1 and "NVIDIA A100" in warnings[0]


def test_a_nodes_own_problem_stops_the_job_and_one_line_counts_the_rest():
    problems, _ = nodes.compare_reports([report(0), report(1, problems=["GLOO_SOCKET_IFNAME=eth9 ..."], peft="0.1")])
    assert problems[0] == "GLOO_SOCKET_IFNAME=eth9 ..." and len(problems) == 2
    assert nodes.one_line(problems) == "GLOO_SOCKET_IFNAME=eth9 ... (and 1 more difference(s))"


def test_missing_nodes_are_named():
    launch = LaunchPlan(4, 0, 1, "10.0.0.1", 29500, rdzv_timeout=30)
    line = nodes.missing_nodes_problem(4, [0, 2], 30.2, launch)
    assert line.startswith("node(s) 1, 3 of 4 never arrived within 30 s (RDZV_TIMEOUT) at 10.0.0.1:29501")


def test_check_port_is_next_to_master_port():
    assert (nodes.check_port(29500), nodes.check_port(65535)) == (29501, 65534)


def test_one_node_skips_the_check(monkeypatch):
    monkeypatch.setattr(nodes, "node_store", lambda *a: pytest.fail("a one-node run opened the node check"))
    nodes.check_nodes(LaunchPlan(1, 0, 8, "127.0.0.1", 29500), {"config": {}})


def test_slurm_cpus_decide_the_threads_per_rank():
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert node_cpus({**job, "SLURM_CPUS_PER_TASK": "16", "SLURM_CPUS_ON_NODE": "64"}) == 16
    assert node_cpus({**job, "SLURM_CPUS_ON_NODE": "12"}) == 12
    assert node_cpus({"SLURM_CPUS_PER_TASK": "16"}) == (__import__("os").cpu_count() or 1)  # not in a job


def test_omp_threads_divide_the_slurm_cpus(monkeypatch):
    from shardtune.launch.supervise import omp_threads

    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "12")
    assert (omp_threads(4), omp_threads(24)) == ("3", "1")


def test_interface_variable_follows_the_device():
    env = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "ib"}
    assert socket_ifname(False, env) == ("GLOO_SOCKET_IFNAME", "eth1")
    assert socket_ifname(True, env) == ("NCCL_SOCKET_IFNAME", "ib")
    assert socket_ifname(False, {}) is None


def test_a_missing_interface_is_a_problem_of_that_node(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    name, address, problems = nodes.route_interface(LaunchPlan(2, 1, 1, "127.0.0.1", 29500), gpu=False)
    assert address == "-" and problems and problems[0].startswith("GLOO_SOCKET_IFNAME=nosuchif0 names no interface")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert nodes.route_interface(LaunchPlan(2, 1, 1, "127.0.0.1", 29500), gpu=False) == ("lo", "127.0.0.1", [])


def run_nodes(launches: list[LaunchPlan], reports: list[dict]) -> list[object]:
    """Each node's exchange in its own thread over a real TCPStore: its problems, or the error it raised."""
    results: list[object] = [None] * len(launches)

    def node(i: int) -> None:
        try:
            with nodes.node_store(launches[i]) as store:
                results[i] = nodes.exchange(store, launches[i], reports[i])[1]
        except ConfigError as err:
            results[i] = err

    threads = [threading.Thread(target=node, args=(i,)) for i in range(len(launches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_every_node_gets_node_zeros_verdict_over_the_store():
    port = find_free_port()
    launches = [LaunchPlan(3, n, 1, "127.0.0.1", port, rdzv_timeout=20) for n in range(3)]
    results = run_nodes(launches, [report(0), report(1), report(2, torch="2.12.0")])
    assert all(r == results[0] for r in results) and len(results[0]) == 1  # type: ignore[arg-type]
    assert "node 2 (host2) differs from node 0 (host0) in torch: 2.13.0 on node 0, 2.12.0 on node 2" in results[0][0]


def test_a_node_that_never_arrives_is_named_after_the_timeout():
    port = find_free_port()
    launches = [LaunchPlan(3, n, 1, "127.0.0.1", port, rdzv_timeout=2) for n in range(2)]
    started = time.monotonic()
    results = run_nodes(launches, [report(0), report(1)])
    assert time.monotonic() - started < 15
    assert results[0] == results[1] and "node(s) 2 of 3 never arrived within 2 s" in results[0][0]  # type: ignore


def test_two_nodes_with_the_same_node_rank_stop_at_once():
    port = find_free_port()
    launches = [LaunchPlan(3, n, 1, "127.0.0.1", port, rdzv_timeout=30) for n in (0, 1, 1)]
    started = time.monotonic()
    results = run_nodes(launches, [report(0), report(1), report(1, host="host9")])
    assert time.monotonic() - started < 15
    assert "more than one node started with NODE_RANK=1" in results[0][0]  # type: ignore[index]


def test_doctor_tables_have_a_column_per_node_and_a_row_per_size():
    from shardtune.launch.doctor import bandwidth_table, facts_table

    table = facts_table([report(0), report(1, transformers="5.22.0")]).splitlines()
    assert table[0].split() == ["node", "0", "node", "1"]
    assert next(x for x in table if x.startswith("transformers")).split() == ["transformers", "5.23.0", "5.22.0"]
    rows = bandwidth_table([(4096, 0.001), (1024**2, 0.01)], LaunchPlan(4, 0, 1, "h", 1)).splitlines()
    assert rows[2].split() == ["4", "KiB", "1.000", "ms", "0.004", "GB/s", "0.006", "GB/s"]  # busbw = x 2*3/4
    assert rows[3].split()[:2] == ["1", "MiB"]


def test_which_launches_are_checked():
    assert not nodes.needs_check(LaunchPlan(1, 0, 8, "h", 1), None)
    assert nodes.needs_check(LaunchPlan(2, 1, 8, "h", 1), "SLURM")
    assert nodes.needs_check(LaunchPlan(2, 1, 8, "h", 1, max_restarts=3), None)  # restarts: same nodes
    assert not nodes.needs_check(LaunchPlan(4, 0, 8, "h", 1, min_nnodes=2, max_nnodes=4), None)
    assert not nodes.needs_check(LaunchPlan(2, 0, 8, "h", 1), "PyTorchJob (elastic)")


def test_node_zero_listens_on_master_addr_only():
    """The check's store has no authentication and carries the resolved config: it listens on the interface of
    MASTER_ADDR, not on every interface of node 0."""
    others = [a for n, a in nodes.interface_addresses().items() if not a.startswith("127.")]
    if not others:
        pytest.skip("this machine has no address besides loopback")
    port = find_free_port()
    with nodes.node_store(LaunchPlan(2, 0, 1, "127.0.0.1", port - 1, rdzv_timeout=5)) as store:
        store.set("probe", "1")
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(OSError), socket.create_connection((others[0], port), timeout=5):
            pass
    sock = nodes.listen_for_nodes("127.0.0.1", find_free_port())
    assert sock.getsockname()[0] == "127.0.0.1"
    sock.close()
