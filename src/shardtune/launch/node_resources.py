"""The CPUs and memory each node (Slurm node, Kubernetes pod) of a written job asks the scheduler for.

Without a request a pod gets what is left on its node and can be evicted under memory pressure, and a Slurm job
gets the site's default, often one CPU and a little memory per task: the ranks then load the model into too little
memory or tokenize on one core. ``--cpus-per-node`` / ``--memory-per-node`` choose; by default each process gets
``CPUS_PER_PROCESS`` CPUs and the node the host memory shardtune's estimate gives for the run (what `shardtune
estimate` shows as CPU memory per node: loading, offloaded states, async_save's staged checkpoint, each rank's
runtime) with a margin. The same estimate sizes a node's checkpoint, and so the warning a scheduler gives before it
kills the job (Slurm's --signal, Kubernetes' terminationGracePeriodSeconds: ``stop_warning``).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardtune.launch.preemption import warning_seconds

if TYPE_CHECKING:
    from shardtune.estimate.parts import Option
    from shardtune.launch.preflight import RunPlan

CPUS_PER_PROCESS = 8  # data loading, tokenization and the rank's own threads
MIN_MEMORY = 8 * 2**30  # one rank's Python, torch and CUDA runtime on the host
MEMORY_PER_PROCESS = 32 * 2**30  # per rank, when the estimate cannot size the model
MARGIN = 1.25  # over the estimate: allocator slack, page cache of the files being read
# A GPU node's memory size is only needed for the estimate's verdict on the device, not for the host figure.
NOMINAL_GPU_MEMORY = 80 * 2**30
UNSIZED_CHECKPOINT = "the minimum: the checkpoint's size was not estimated"
_UNITS = {"": 2**30, "k": 2**10, "ki": 2**10, "m": 2**20, "mi": 2**20, "g": 2**30, "gi": 2**30, "t": 2**40,
          "ti": 2**40}


@dataclass(frozen=True)
class NodeResources:
    """What one node requests: CPUs, and memory in bytes (``memory_source`` says where the number came from)."""

    cpus: int
    memory: int
    memory_source: str = "given"

    @property
    def memory_gib(self) -> int:
        return max(1, math.ceil(self.memory / 2**30))

    def describe(self) -> str:
        memory = f"{self.memory_gib} GiB of memory ({self.memory_source})" if self.memory else "no memory amount"
        return f"{self.cpus} CPUs and {memory}"

    def k8s_requests(self) -> dict[str, str]:
        return {"cpu": str(self.cpus), **({"memory": f"{self.memory_gib}Gi"} if self.memory else {})}

    @property
    def slurm_memory(self) -> str:
        return f"{self.memory_gib}G" if self.memory else "0"  # Slurm's G is 1024 MiB; --mem=0: the whole node


def add_resource_arguments(parser: argparse.ArgumentParser, node: str) -> None:
    parser.add_argument("--cpus-per-node", type=int, dest="cpus_per_node",
                        help=f"CPUs each {node} requests (default: {CPUS_PER_PROCESS} per process)")
    parser.add_argument("--memory-per-node", dest="memory_per_node",
                        help=f"memory each {node} requests, e.g. 200G; 0: all of a Slurm node's memory (--mem=0), "
                             "no request on Kubernetes (default: shardtune's estimate of the run's host memory per "
                             "node, with a margin)")


def parse_memory(text: str) -> int:
    """``200G``, ``200Gi``, ``512M``, ``1.5T`` -> bytes (a bare number is GiB); ValueError when unreadable."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT][iI]?)?[bB]?\s*", text)
    if match is None:
        raise ValueError(text)
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def resource_problems(cpus: int | None, memory: str | None) -> list[str]:
    problems = []
    if cpus is not None and cpus < 1:
        problems.append(f"--cpus-per-node must be >= 1 (got {cpus})")
    if memory is not None:
        try:
            if 0 < parse_memory(memory) < 2**30:
                problems.append(f"--memory-per-node {memory} is below 1 GiB; give e.g. 200G")
        except ValueError:
            problems.append(f"--memory-per-node {memory!r} is not a size; give e.g. 200G or 512Gi")
    return problems


def node_resources(cpus: int | None, memory: str | None, nproc_per_node: int,
                   estimated_memory: int | None) -> NodeResources:
    """The request: the user's values, else CPUS_PER_PROCESS per process and the estimate with a margin."""
    if memory is not None:
        amount, source = parse_memory(memory), "--memory-per-node"
    elif estimated_memory is not None:
        amount, source = max(MIN_MEMORY, int(estimated_memory * MARGIN)), "estimate"
    else:
        amount, source = MEMORY_PER_PROCESS * nproc_per_node, "default"
    return NodeResources(cpus=cpus or CPUS_PER_PROCESS * nproc_per_node, memory=amount, memory_source=source)


def estimated_option(plan: RunPlan, gpus_per_node: int) -> Option | None:
    """The memory estimate of the engine this plan runs (None when it cannot size the model)."""
    from shardtune.errors import ShardtuneError
    from shardtune.estimate.config import configured_option, hardware_for

    layout = plan.layout
    hardware = hardware_for(layout.world_size, layout.procs_per_node,
                            NOMINAL_GPU_MEMORY if gpus_per_node else None, 2**50)
    try:
        return configured_option(plan.config, hardware, engine=plan.engine)
    except (ShardtuneError, OSError, ValueError, KeyError):
        return None


def estimated_node_memory(option: Option | None) -> int | None:
    """Host bytes per node the memory estimate gives (async_save's staged checkpoint included); None without one."""
    return (int(option.cpu_per_node) or None) if option else None


def estimated_checkpoint_bytes(option: Option | None) -> int:
    """What the ranks of one node (the one with rank 0) write in one checkpoint; 0 without an estimate."""
    return int(option.checkpoint_per_node) if option else 0


def stop_warning(given: int | None, flag: str, checkpoint_bytes_per_node: int) -> tuple[int, str]:
    """Seconds a scheduler should warn the ranks before it kills them (Slurm's --signal, Kubernetes' grace period),
    and where the number came from: ``flag``'s value, else the time a node's checkpoint needs to be written
    (launch/preemption.py, ``warning_seconds``)."""
    if given is not None:
        return given, flag
    if not checkpoint_bytes_per_node:
        return warning_seconds(0), UNSIZED_CHECKPOINT
    return (warning_seconds(checkpoint_bytes_per_node),
            f"time to write a node's checkpoint, estimated {checkpoint_bytes_per_node / 2**30:.2f} GiB")
