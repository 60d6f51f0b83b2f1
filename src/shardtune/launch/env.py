"""The only module that reads launcher environment variables (ours, torchrun's, accelerate's, SLURM's, Kubeflow's,
Ray's: inside a Ray Train worker, Ray's TorchConfig has set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
MASTER_ADDR/PORT like torchrun does, so ``read_rank_env`` reads a Ray rank unchanged).

The schedulers' variables are interpreted by pure functions in launch/slurm.py and launch/kubernetes.py, which
get the environment from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardtune.errors import ConfigError
from shardtune.launch import kubernetes, slurm
from shardtune.launch.cluster import ClusterLaunch, merge_problems
from shardtune.world import RankEnv


def read_rank_env(env: Mapping[str, str] | None = None) -> RankEnv:
    """This rank's place in the job; variables set by hand (a stale RANK in the shell) are checked too."""
    env = os.environ if env is None else env
    problems: list[str] = []
    world_size = _int_variable(env, "WORLD_SIZE", 1, None, problems) or 1
    rank = _int_variable(env, "RANK", 0, world_size - 1, problems) or 0
    local_world_size = _int_variable(env, "LOCAL_WORLD_SIZE", 1, None, problems) or world_size
    local_rank = _int_variable(env, "LOCAL_RANK", 0, local_world_size - 1, problems) or 0
    master_port = _int_variable(env, "MASTER_PORT", 1, 65535, problems)
    if problems:
        raise ConfigError(*problems)
    return RankEnv(rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
                   master_addr=env.get("MASTER_ADDR"), master_port=master_port,
                   restart_count=elastic_restart_count(env))


def elastic_restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times torchrun has restarted this job's workers (0 on the first attempt)."""
    env = os.environ if env is None else env
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def scheduler_restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times the scheduler requeued this job (Slurm's SLURM_RESTART_COUNT; 0 on the first attempt)."""
    env = os.environ if env is None else env
    value = env.get("SLURM_RESTART_COUNT", "0") or "0"
    return int(value) if value.isdigit() else 0


def inside_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True when a launcher (torchrun, deepspeed, accelerate) already started this process as a rank.

    A Kubeflow PyTorchJob pod has RANK and WORLD_SIZE too, but for the pod: there shardtune still launches.
    """
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env and not kubernetes.is_operator_pod(env)


@dataclass(frozen=True)
class LaunchEnv:
    """LLaMA-Factory's launch contract: FORCE_TORCHRUN, NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_*, elastic."""

    force_torchrun: bool = False
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_id: str | None = None
    min_nnodes: int | None = None
    max_nnodes: int | None = None
    max_restarts: int = 0
    rdzv_timeout: int | None = None
    scheduler: str | None = None  # SLURM, PyTorchJob, TrainJob: whose variables decided the nodes
    c10d_rendezvous: bool = False
    use_ray: bool = False  # USE_RAY=1: Ray Train starts the ranks (launch/ray_job.py), not torchrun


# Integer launch variables and the values they may take (inclusive; None: no bound).
_INT_RANGES: dict[str, tuple[int | None, int | None]] = {
    "NNODES": (1, None), "NODE_RANK": (0, None), "NPROC_PER_NODE": (1, None), "MASTER_PORT": (1, 65535),
    "MIN_NNODES": (1, None), "MAX_NNODES": (1, None), "MAX_RESTARTS": (0, None), "RDZV_TIMEOUT": (1, None),
}
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False, "": False}


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Parse the launch variables; every malformed or out-of-range one is named, all in one error."""
    env = os.environ if env is None else env
    problems: list[str] = []
    ints = {name: value for name, (low, high) in _INT_RANGES.items()
            if (value := _int_variable(env, name, low, high, problems)) is not None}
    force = _flag(env, "FORCE_TORCHRUN", "set FORCE_TORCHRUN=1 to always launch through torchrun", problems)
    use_ray = _flag(env, "USE_RAY", "set USE_RAY=1 to start the ranks through Ray Train", problems)
    cluster, cluster_problems = read_cluster_launch(env)
    problems += cluster_problems
    if cluster is not None:
        problems += merge_problems(cluster, env, ints)
        ints = _with_cluster_values(ints, cluster)
    problems += _node_problems(ints)
    if cluster is None and not use_ray:  # (Ray places the workers itself; NNODES is refused under it)
        problems += _by_hand_node_problems(env, ints)
    if use_ray:
        problems += _ray_problems(ints, cluster)
    if problems:
        raise ConfigError(*problems)
    return LaunchEnv(
        force_torchrun=force,
        use_ray=use_ray,
        nnodes=ints.get("NNODES", 1),
        node_rank=ints.get("NODE_RANK", 0),
        nproc_per_node=ints.get("NPROC_PER_NODE"),
        master_addr=(cluster.master_addr if cluster else env.get("MASTER_ADDR")) or "127.0.0.1",
        master_port=ints.get("MASTER_PORT"),
        rdzv_id=env.get("RDZV_ID") or (cluster.rdzv_id if cluster else None),
        min_nnodes=ints.get("MIN_NNODES"),
        max_nnodes=ints.get("MAX_NNODES"),
        scheduler=cluster.scheduler if cluster else None,
        c10d_rendezvous=cluster.c10d_rendezvous if cluster else False,
        max_restarts=ints.get("MAX_RESTARTS", 0),
        rdzv_timeout=ints.get("RDZV_TIMEOUT"),
    )


def run_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """What the processes of one job share and another job's lack, for the run lock (launch/run_lock.py): the
    ranks of a launcher's job (its rendezvous), or the nodes of a multi-node launch. None for a one-node launch
    by shardtune, whose launching process alone holds the lock."""
    env = os.environ if env is None else env
    if inside_launcher(env):
        return (f"ranks@{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}/"
                f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('WORLD_SIZE', '')}")
    try:
        launch = read_launch_env(env)
    except ConfigError:
        return None
    if launch.nnodes == 1:
        return None
    return f"nodes@{launch.master_addr}:{launch.master_port}/{launch.rdzv_id or ''}/{launch.nnodes}"


def ray_requested(env: Mapping[str, str] | None = None) -> bool:
    """USE_RAY=1, read on its own: the Ray keys are checked even when another launch variable is bad."""
    env = os.environ if env is None else env
    return _flag(env, "USE_RAY", "", [])


def _flag(env: Mapping[str, str], name: str, remedy: str, problems: list[str]) -> bool:
    """A 1/0 (true/false, yes/no) variable; unset is false, anything else is a problem naming it."""
    raw = env.get(name, "0").strip().lower()
    if raw not in _FLAGS:
        problems.append(f"environment variable {name}={env[name]!r} is not 1/0 (or true/false); {remedy}")
        return False
    return _FLAGS[raw]


def _ray_problems(ints: Mapping[str, int], cluster: ClusterLaunch | None) -> list[str]:
    """Under USE_RAY=1 Ray places every worker: a node layout given for torchrun would be silently ignored."""
    if cluster is not None:
        return [f"USE_RAY=1 inside a {cluster.scheduler} job: start a Ray cluster on the job's nodes and run "
                "shardtune once with RAY_ADDRESS set, or unset USE_RAY to launch with torchrun"]
    return [f"{name}={ints[name]} is set with USE_RAY=1: Ray places the workers (ray_num_workers, "
            f"placement_strategy); unset {name}"
            for name in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MIN_NNODES", "MAX_NNODES") if name in ints]


def read_cluster_launch(env: Mapping[str, str]) -> tuple[ClusterLaunch | None, list[str]]:
    """What SLURM or the Kubeflow operator decided about the nodes (None when neither started this process).

    Inside a rank (RANK set by torchrun) the scheduler's variables are still there but no longer apply.
    """
    if "LOCAL_RANK" in env and "RANK" in env:
        return None, []
    launch, problems = slurm.read_slurm_launch(env)
    if launch is not None or problems:
        return launch, problems
    return kubernetes.read_kubeflow_launch(env)


def _with_cluster_values(ints: Mapping[str, int], cluster: ClusterLaunch) -> dict[str, int]:
    """The scheduler's numbers; where it leaves one open (CPU processes per node, a port) the user's stays."""
    merged = dict(ints)
    for name, value in (("NNODES", cluster.nnodes), ("NODE_RANK", cluster.node_rank),
                        ("NPROC_PER_NODE", cluster.nproc_per_node), ("MIN_NNODES", cluster.min_nnodes),
                        ("MAX_NNODES", cluster.max_nnodes)):
        if value is not None:
            merged[name] = value
    for name, value in (("MASTER_PORT", cluster.master_port), ("MAX_RESTARTS", cluster.max_restarts)):
        if value is not None and name not in ints:
            merged[name] = value
    return merged


def _int_variable(env: Mapping[str, str], name: str, low: int | None, high: int | None,
                  problems: list[str]) -> int | None:
    """The integer value of ``name`` (None when unset); a bad one adds a problem naming it and its range."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        problems.append(f"environment variable {name}={raw!r} is not an integer; {_range_text(name, low, high)}")
        return None
    if (low is not None and value < low) or (high is not None and value > high):
        problems.append(f"environment variable {name}={value} is out of range; {_range_text(name, low, high)}")
        return None
    return value


def _range_text(name: str, low: int | None, high: int | None) -> str:
    if high is not None:
        return f"set {name} to a whole number from {low} to {high}, or unset it"
    return f"set {name} to a whole number >= {low}, or unset it"


def _by_hand_node_problems(env: Mapping[str, str], ints: Mapping[str, int]) -> list[str]:
    """Several nodes started by hand (no scheduler): each must be told where node 0 is and which node it is;
    the defaults (127.0.0.1, node 0) would make every node wait for itself until the rendezvous times out."""
    nnodes = ints.get("NNODES", 1)
    if nnodes <= 1:
        return []
    problems = []
    if not env.get("MASTER_ADDR"):
        problems.append(f"MASTER_ADDR must be set when NNODES={nnodes}: node 0's address, the same on every node")
    elastic = bool(env.get("RDZV_ID")) or "MIN_NNODES" in ints or "MAX_NNODES" in ints
    if "NODE_RANK" not in ints and not elastic:
        problems.append(f"NODE_RANK must be set when NNODES={nnodes}: 0 on the node at MASTER_ADDR, 1..{nnodes - 1} "
                        "on the others (or set RDZV_ID for an elastic launch that numbers the nodes itself)")
    return problems


def _node_problems(ints: Mapping[str, int]) -> list[str]:
    """Rules between the variables: the node rank fits the node count, several nodes agree on a port."""
    nnodes, problems = ints.get("NNODES", 1), []
    if ints.get("NODE_RANK", 0) >= nnodes:
        problems.append(f"NODE_RANK={ints['NODE_RANK']} must be in 0..{nnodes - 1} for NNODES={nnodes}")
    if nnodes > 1 and "MASTER_PORT" not in ints:
        problems.append(f"MASTER_PORT must be set when NNODES={nnodes}: every node must use the same port")
    low, high = ints.get("MIN_NNODES"), ints.get("MAX_NNODES")
    if low is not None and high is not None and low > high:
        problems.append(f"MIN_NNODES ({low}) is above MAX_NNODES ({high}); swap them")
    return problems


def accelerate_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What `accelerate launch` passed to this worker (ACCELERATE_*, FSDP_*), empty when not under it."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def socket_ifname(gpu: bool, env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The interface the user named for the collectives: (variable, value) of NCCL_SOCKET_IFNAME on GPU nodes,
    GLOO_SOCKET_IFNAME on CPU nodes; None when unset (then the one routing to MASTER_ADDR is used)."""
    env = os.environ if env is None else env
    name = "NCCL_SOCKET_IFNAME" if gpu else "GLOO_SOCKET_IFNAME"
    value = env.get(name, "").strip()
    return (name, value) if value else None


def node_cpus(env: Mapping[str, str] | None = None) -> int:
    """CPUs this node's ranks share: inside a Slurm allocation the ones Slurm gave this task (SLURM_CPUS_PER_TASK,
    else SLURM_CPUS_ON_NODE), which can be far fewer than the machine has; else os.cpu_count()."""
    env = os.environ if env is None else env
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        raw = env.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0 and slurm.in_allocation(env):
            return int(raw)
    return os.cpu_count() or 1
