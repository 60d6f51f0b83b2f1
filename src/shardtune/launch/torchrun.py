"""The torchrun command for each node, built as an argument list (never a shell string). Pure."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from shardtune.launch.env import LaunchEnv
from shardtune.world import WorldLayout


@dataclass(frozen=True)
class LaunchPlan:
    """How many processes on how many nodes, and where they meet."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    rdzv_id: str | None = None
    min_nnodes: int | None = None
    max_nnodes: int | None = None
    max_restarts: int = 0
    rdzv_timeout: int | None = None
    # Set under SLURM and an elastic PyTorchJob: every node runs the same command, torchrun numbers the nodes.
    c10d_rendezvous: bool = False
    force_torchrun: bool = False  # FORCE_TORCHRUN: torchrun even for one process
    master_port_given: bool = False  # MASTER_PORT was set (node 0 checks it is free), not picked here
    use_ray: bool = False  # USE_RAY=1: Ray Train starts ray_num_workers ranks instead (launch/ray_job.py)

    @property
    def world_size(self) -> int:
        return WorldLayout(self.nnodes, self.nproc_per_node).world_size

    @property
    def is_elastic(self) -> bool:
        return self.max_restarts > 0 or self.min_nnodes is not None or self.max_nnodes is not None


def plan_launch(env: LaunchEnv, visible_gpus: int, free_port: int | None = None) -> LaunchPlan:
    """Apply defaults: NPROC_PER_NODE = visible GPUs (1 on CPU); MASTER_PORT = a free port on one node."""
    # Each variable's range and the rules between them were checked when they were read (launch/env.py).
    nproc = env.nproc_per_node if env.nproc_per_node is not None else max(visible_gpus, 1)
    port = env.master_port
    return LaunchPlan(
        nnodes=env.nnodes, node_rank=env.node_rank, nproc_per_node=nproc, master_addr=env.master_addr,
        master_port=port if port is not None else (free_port or find_free_port()),
        rdzv_id=env.rdzv_id, min_nnodes=env.min_nnodes, max_nnodes=env.max_nnodes, max_restarts=env.max_restarts,
        rdzv_timeout=env.rdzv_timeout, c10d_rendezvous=env.c10d_rendezvous, force_torchrun=env.force_torchrun,
        master_port_given=port is not None, use_ray=env.use_ray,
    )


def device_problems(plan: LaunchPlan, visible_gpus: int, visible_setting: str | None,
                    scheduler: str | None = None) -> list[str]:
    """Each rank takes the GPU of its LOCAL_RANK: more processes per node than GPUs this process sees would end
    in "invalid device ordinal" on the extra ranks (CPU machines run any number of processes)."""
    if plan.use_ray or visible_gpus == 0 or plan.nproc_per_node <= visible_gpus:
        return []
    seen = f"CUDA_VISIBLE_DEVICES={visible_setting}" if visible_setting is not None else "all of this machine's"
    fix = f"set NPROC_PER_NODE={visible_gpus} (or unset it), or make more GPUs visible"
    if scheduler == "SLURM":
        fix = ("start shardtune once per node with all of the node's GPUs (`srun --ntasks-per-node=1 "
               "--gpus-per-node=N`, not --gpus-per-task=1), or " + fix)
    return [f"NPROC_PER_NODE={plan.nproc_per_node} starts {plan.nproc_per_node} processes on this node, but it sees "
            f"{visible_gpus} GPU(s) ({seen}) and each process needs its own: {fix}"]


# torch.distributed.run's main, started through shardtune.launch.torchrun_agent (which skips the final collection of
# the agent's objects at exit: 0.3 s per run on this CPU).
TORCHRUN_MODULE = "shardtune.launch.torchrun_agent"


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_torchrun_argv(plan: LaunchPlan, node_rank: int, worker: list[str], python: str) -> list[str]:
    """torchrun's command for one node (``python -m shardtune.launch.torchrun_agent``: torchrun's own main with a
    faster exit), followed by the worker command."""
    argv = [python, "-m", TORCHRUN_MODULE, f"--nproc-per-node={plan.nproc_per_node}"]
    if plan.is_elastic or plan.c10d_rendezvous:
        low = plan.min_nnodes or plan.nnodes
        high = plan.max_nnodes or plan.nnodes
        argv += [
            f"--nnodes={low}:{high}" if plan.is_elastic else f"--nnodes={plan.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={plan.master_addr}:{plan.master_port}",
            f"--rdzv-id={plan.rdzv_id or 'shardtune'}",
        ]
        if plan.is_elastic:
            argv.append(f"--max-restarts={plan.max_restarts}")
    else:
        argv += [
            f"--nnodes={plan.nnodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={plan.master_addr}",
            f"--master-port={plan.master_port}",
        ]
    if plan.rdzv_timeout is not None:
        # Bounds how long the nodes wait for each other (a node that never starts ends the job, not a hang).
        argv.append(f"--rdzv-conf=join_timeout={plan.rdzv_timeout},timeout={plan.rdzv_timeout}")
    return argv + worker


def worker_argv(config_path: str, debug: bool = False) -> list[str]:
    """What each rank runs: the module entry with the resolved config written by the launching host."""
    return ["-m", "shardtune.train", config_path, *(["--debug"] if debug else [])]
