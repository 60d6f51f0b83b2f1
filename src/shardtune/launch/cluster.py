"""What a scheduler (SLURM, Kubeflow) says about the job's nodes, and how it meets the user's own launch variables.

The scheduler modules (slurm.py, kubernetes.py) turn the variables env.py hands them into a ``ClusterLaunch``;
``merge_problems`` refuses a user variable (NNODES, MASTER_ADDR, ...) that says something else, because two
nodes that disagree on the node count or the master wait for each other until the rendezvous times out.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterLaunch:
    """The launch values one scheduler gives this node; ``sources`` names the variable behind each value."""

    scheduler: str
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None = None
    nproc_per_node: int | None = None
    rdzv_id: str | None = None
    # c10d rendezvous: torchrun assigns node ranks itself, so no node needs a NODE_RANK of its own.
    c10d_rendezvous: bool = False
    min_nnodes: int | None = None
    max_nnodes: int | None = None
    max_restarts: int | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def value_of(self, name: str) -> int | str | None:
        """This launch's value for one of our variable names (NNODES, NODE_RANK, ...)."""
        return {"NNODES": self.nnodes, "NODE_RANK": self.node_rank, "NPROC_PER_NODE": self.nproc_per_node,
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": self.master_port}[name]


# Our variables a scheduler may also decide, in the order problems are reported.
MERGED_VARIABLES = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT")


def merge_problems(cluster: ClusterLaunch, env: Mapping[str, str], ints: Mapping[str, int]) -> list[str]:
    """One line for each user variable that contradicts the scheduler's value, naming both values."""
    problems = []
    for name in MERGED_VARIABLES:
        source = cluster.sources.get(name)
        ours = cluster.value_of(name)
        if source is None or ours is None or source.split("=", 1)[0] == name or not env.get(name, "").strip():
            continue
        given = ints.get(name) if name != "MASTER_ADDR" else env[name].strip()
        if given is not None and given != ours:
            problems.append(f"{name}={given} contradicts {cluster.scheduler}'s {source} ({name} would be {ours}): "
                            f"unset {name}, shardtune takes it from {cluster.scheduler}")
    return problems


def add_node_shape_arguments(parser: argparse.ArgumentParser, node: str) -> None:
    """The config and the nodes x processes shape, common to `shardtune slurm` and `shardtune k8s` (``node``:
    what one machine is called there, "node" or "pod")."""
    parser.add_argument("config")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True, help=f"0 for CPU {node}s")
    parser.add_argument("--nproc-per-node", type=int,
                        help=f"processes per {node} (default: the GPU count, 1 on CPU)")


def node_shape_problems(nodes: int, gpus_per_node: int, nproc_per_node: int | None) -> list[str]:
    """The --nodes / --gpus-per-node / --nproc-per-node of `shardtune slurm` and `shardtune k8s`."""
    problems = [f"--{flag} must be >= {low} (got {value})"
                for flag, value, low in (("nodes", nodes, 1), ("gpus-per-node", gpus_per_node, 0),
                                         ("nproc-per-node", nproc_per_node, 1))
                if value is not None and value < low]
    if nproc_per_node and gpus_per_node and nproc_per_node != gpus_per_node:
        problems.append(f"--nproc-per-node ({nproc_per_node}) differs from --gpus-per-node ({gpus_per_node}); "
                        "shardtune runs one process per GPU: drop --nproc-per-node")
    return problems


def processes_per_node(gpus_per_node: int, nproc_per_node: int | None) -> int:
    """One process per GPU; on CPU nodes --nproc-per-node, else 1."""
    return nproc_per_node or gpus_per_node or 1
