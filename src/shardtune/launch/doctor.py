"""`shardtune doctor`: the node check of `shardtune train` as a table, plus a short all-reduce test across the nodes.

Start it on every node the way `shardtune train` is started (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, or inside
srun / a Kubeflow pod). The nodes meet through the same TCPStore as the node check; when they agree, one process
per node joins a process group on that store (gloo on CPU, NCCL on GPU 0 of each node) and times all-reduces of a
few sizes. Node 0 prints both tables. On one node it prints the node's facts only: nothing crosses the network.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from shardtune.arguments import CommandParser, whole_number
from shardtune.errors import ConfigError
from shardtune.host import visible_gpu_count
from shardtune.launch import nodes
from shardtune.launch.env import read_launch_env
from shardtune.launch.torchrun import LaunchPlan, plan_launch

SIZES = (4 * 1024, 1024**2, 16 * 1024**2, 64 * 1024**2)  # bytes: latency-bound up to bandwidth-bound


def doctor_command(args: list[str]) -> int:
    parser = CommandParser(prog="shardtune doctor", description=__doc__)
    parser.add_argument("config", nargs="*", help="optional: CONFIG.yaml [key=value ...] to compare the run plan too")
    parser.add_argument("--iterations", type=whole_number(1, 10000), default=5,
                        help="timed all-reduces per size (default 5)")
    ns = parser.parse_args(args)
    env = read_launch_env()
    launch = plan_launch(env, visible_gpu_count())
    run_plan = None
    if ns.config:
        from shardtune.launch.preflight import plan_run, run_plan_dict

        run_plan = run_plan_dict(plan_run(ns.config))
    report = nodes.node_report(launch, run_plan)
    if not nodes.needs_check(launch, env.scheduler):
        print(facts_table([report]))
        print(f"all-reduce: skipped, {'one node' if launch.nnodes == 1 else 'an elastic launch (nodes unnumbered)'}"
              " (start doctor on every node of a fixed node count to test the network)")
        if report["problems"]:
            raise ConfigError(nodes.one_line(report["problems"]))
        return 0
    with nodes.node_store(launch, env.scheduler) as store:
        reports, problems = nodes.exchange(store, launch, report)
        if launch.node_rank == 0:
            print(facts_table(reports), flush=True)
        if problems:
            raise ConfigError(nodes.one_line(problems))
        rows = allreduce_test(store, launch, ns.iterations)
    if launch.node_rank == 0:
        print(bandwidth_table(rows, launch))
    else:
        print(f"node {launch.node_rank}: checked and tested with node 0; node 0 prints the tables")
    return 0


def facts_table(reports: Sequence[Mapping[str, Any]]) -> str:
    """One row per fact, one column per node."""
    fields = ("host", *nodes.EQUAL_FIELDS, *nodes.WARN_FIELDS, *nodes.INFO_FIELDS[1:])
    header = ["", *(f"node {r['node']}" for r in reports)]
    rows = [header] + [[f, *(str(r.get(f, "-")) for r in reports)] for f in fields]
    return _aligned(rows)


def _aligned(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def allreduce_test(store: Any, launch: LaunchPlan, iterations: int) -> list[tuple[int, float]]:
    """(bytes, median seconds) per size: one process per node in a group formed on the node check's store."""
    import torch
    import torch.distributed as dist

    gpu = visible_gpu_count() > 0
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.PrefixStore("doctor/", store),
                            rank=launch.node_rank, world_size=launch.nnodes, device_id=device if gpu else None)
    try:
        rows = []
        for size in SIZES:
            tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
            dist.all_reduce(tensor)  # warm-up: connections, buffers
            times = []
            for _ in range(iterations):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                if gpu:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            rows.append((size, statistics.median(times)))
        dist.barrier()
        return rows
    finally:
        dist.destroy_process_group()


def bandwidth_table(rows: Sequence[tuple[int, float]], launch: LaunchPlan) -> str:
    """Median time per all-reduce; algorithm bandwidth (size / time) and bus bandwidth (x 2(n-1)/n, what each
    link carries in a ring), as nccl-tests report them."""
    n = launch.nnodes
    backend = "nccl" if visible_gpu_count() > 0 else "gloo"
    table = [["size", "time", "algbw", "busbw"]]
    for size, seconds in rows:
        algbw = size / seconds / 1e9
        busbw = algbw * 2 * (n - 1) / n
        table.append([_size(size), f"{seconds * 1e3:.3f} ms", f"{algbw:.3f} GB/s", f"{busbw:.3f} GB/s"])
    return f"all-reduce, {backend}, {n} nodes x 1 process, fp32 (median of timed runs):\n" + _aligned(table)


def _size(size: int) -> str:
    return f"{size // 1024**2} MiB" if size >= 1024**2 else f"{size // 1024} KiB"
