"""Pods started by the Kubeflow training operator: its variables -> nodes, node rank and processes per node.

Pure functions over the variables launch/env.py hands over. A pod is recognised by KUBERNETES_SERVICE_HOST
(every pod has it) plus the operator's own variables:

- TrainJob (Kubeflow Trainer v2, torch runtime): PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR,
  PET_MASTER_PORT -- torchrun's own spelling; no RANK or WORLD_SIZE.
- PyTorchJob (kubeflow.org/v1) with an elasticPolicy: PET_RDZV_ENDPOINT (c10d), PET_NNODES as "min:max",
  PET_RDZV_ID, PET_MAX_RESTARTS.
- PyTorchJob (kubeflow.org/v1): MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK, set on every pod, with PET_NNODES
  (operator >= 1.7) or a pod named <job>-master-0 / <job>-worker-<i> (HOSTNAME). RANK is the
  *pod's* index (master 0, worker i -> i+1) and WORLD_SIZE the number of pods (operator >= 1.7 with nprocPerNode:
  pods x nprocPerNode, with PET_NPROC_PER_NODE and PET_NODE_RANK next to it). Read as a process rank -- which is
  what torch does with RANK -- every pod would think it is the only process of its rank, and the run hangs at the
  first collective. Here RANK becomes NODE_RANK, and torchrun sets each process's own RANK.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from shardtune.launch.cluster import ClusterLaunch

TRAINJOB, PYTORCHJOB, PYTORCHJOB_ELASTIC = "TrainJob", "PyTorchJob", "PyTorchJob (elastic)"


def operator_flavour(env: Mapping[str, str]) -> str | None:
    """Which Kubeflow launch started this pod (None: not a Kubeflow training pod)."""
    if not env.get("KUBERNETES_SERVICE_HOST") or _started_by_torchrun(env):
        return None
    if env.get("PET_RDZV_ENDPOINT"):
        return PYTORCHJOB_ELASTIC
    if _pytorchjob_variables(env):
        return PYTORCHJOB
    if env.get("PET_NNODES") and env.get("PET_MASTER_ADDR"):
        return TRAINJOB
    return None


def _pytorchjob_variables(env: Mapping[str, str]) -> bool:
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as the operator sets them, not a hand-made set in some pod.

    Its sign: PET_NNODES (operator >= 1.7), or the pod name it gives, ``<job>-master-0`` / ``<job>-worker-<i>``
    (Kubernetes puts the pod name in HOSTNAME).
    """
    if any(env.get(name) is None for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return False
    return bool(env.get("PET_NNODES")) or re.search(r"-(master|worker)-\d+$", env.get("HOSTNAME", "")) is not None


def is_operator_pod(env: Mapping[str, str]) -> bool:
    """A PyTorchJob pod sets RANK and WORLD_SIZE for the pod, not for a rank a launcher started."""
    return operator_flavour(env) is not None


def _started_by_torchrun(env: Mapping[str, str]) -> bool:
    # torchrun (and the deepspeed launcher) give each rank a LOCAL_RANK; the operator never sets one.
    return env.get("LOCAL_RANK") is not None or env.get("TORCHELASTIC_RUN_ID") is not None


def read_kubeflow_launch(env: Mapping[str, str]) -> tuple[ClusterLaunch | None, list[str]]:
    """The launch this pod takes part in (None outside a Kubeflow training pod), with every problem found."""
    flavour = operator_flavour(env)
    if flavour is None:
        return None, []
    problems: list[str] = []
    reader = {TRAINJOB: _trainjob, PYTORCHJOB: _pytorchjob, PYTORCHJOB_ELASTIC: _elastic}[flavour]
    launch = reader(env, problems)
    return (None if problems else launch), problems


def _trainjob(env: Mapping[str, str], problems: list[str]) -> ClusterLaunch:
    nnodes = _number(env, "PET_NNODES", 1, problems) or 1
    node_rank = _number(env, "PET_NODE_RANK", 0, problems) or 0
    nproc = _nproc(env, problems)
    _rank_fits(node_rank, nnodes, "PET_NODE_RANK", "PET_NNODES", problems)
    return ClusterLaunch(
        scheduler=TRAINJOB, nnodes=nnodes, node_rank=node_rank, master_addr=env["PET_MASTER_ADDR"],
        master_port=_number(env, "PET_MASTER_PORT", 1, problems), nproc_per_node=nproc,
        sources=_sources(env, NNODES="PET_NNODES", NODE_RANK="PET_NODE_RANK", NPROC_PER_NODE="PET_NPROC_PER_NODE",
                         MASTER_ADDR="PET_MASTER_ADDR", MASTER_PORT="PET_MASTER_PORT"))


def _pytorchjob(env: Mapping[str, str], problems: list[str]) -> ClusterLaunch:
    pod_rank = _number(env, "RANK", 0, problems) or 0
    pods_or_world = _number(env, "WORLD_SIZE", 1, problems) or 1
    nproc = _nproc(env, problems)
    node_rank = pod_rank
    if env.get("PET_NODE_RANK"):
        node_rank = _number(env, "PET_NODE_RANK", 0, problems) or 0
        if node_rank != pod_rank:
            problems.append(f"PET_NODE_RANK={node_rank} and RANK={pod_rank} disagree on this pod's index; "
                            "unset the one you set by hand (the operator sets both to the same value)")
    nnodes = _pytorchjob_nodes(env, pods_or_world, nproc, problems)
    _rank_fits(node_rank, nnodes, "RANK", "the pod count", problems)
    return ClusterLaunch(
        scheduler=PYTORCHJOB, nnodes=nnodes, node_rank=node_rank, master_addr=env.get("MASTER_ADDR") or "",
        master_port=_number(env, "MASTER_PORT", 1, problems), nproc_per_node=nproc,
        sources=_sources(env, NNODES="PET_NNODES" if env.get("PET_NNODES") else "WORLD_SIZE", NODE_RANK="RANK",
                         NPROC_PER_NODE="PET_NPROC_PER_NODE", MASTER_ADDR="MASTER_ADDR", MASTER_PORT="MASTER_PORT"))


def _pytorchjob_nodes(env: Mapping[str, str], world: int, nproc: int | None, problems: list[str]) -> int:
    """Pods in the job: PET_NNODES when set; else WORLD_SIZE, which counts pods, or pods x nprocPerNode."""
    if env.get("PET_NNODES"):
        nnodes = _number(env, "PET_NNODES", 1, problems) or 1
    elif nproc and world % nproc == 0 and env.get("PET_NPROC_PER_NODE"):
        nnodes = world // nproc
    else:
        nnodes = world
    if world not in (nnodes, nnodes * (nproc or 1)):
        problems.append(f"WORLD_SIZE={world} is neither the pod count ({nnodes}) nor pods x processes per pod "
                        f"({nnodes} x {nproc}); unset the WORLD_SIZE you set by hand")
    return nnodes


def _elastic(env: Mapping[str, str], problems: list[str]) -> ClusterLaunch:
    endpoint = env["PET_RDZV_ENDPOINT"]
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        problems.append(f"PET_RDZV_ENDPOINT={endpoint!r} is not host:port")
    low, high = _node_range(env.get("PET_NNODES", "1"), problems)
    return ClusterLaunch(
        scheduler=PYTORCHJOB_ELASTIC, nnodes=high, node_rank=_number(env, "PET_NODE_RANK", 0, problems) or 0,
        master_addr=host or endpoint,
        master_port=int(port) if port.isdigit() else None, nproc_per_node=_nproc(env, problems),
        rdzv_id=env.get("PET_RDZV_ID") or None, c10d_rendezvous=True,
        min_nnodes=low if low != high else None, max_nnodes=high if low != high else None,
        max_restarts=_number(env, "PET_MAX_RESTARTS", 0, problems),
        # A Master replica's MASTER_ADDR may name another pod than the rendezvous endpoint: it is not used here.
        sources=_sources(env, NNODES="PET_NNODES", NPROC_PER_NODE="PET_NPROC_PER_NODE"))


def _node_range(text: str, problems: list[str]) -> tuple[int, int]:
    low, _, high = text.strip().partition(":")
    high = high or low
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        problems.append(f"PET_NNODES={text!r} is not a node count or a range like 1:4")
        return 1, 1
    return int(low), int(high)


def _nproc(env: Mapping[str, str], problems: list[str]) -> int | None:
    """PET_NPROC_PER_NODE as a number; auto/gpu/cpu (Trainer's symbolic values) leave the choice to the GPU count."""
    raw = env.get("PET_NPROC_PER_NODE", "").strip()
    if not raw or raw in ("auto", "gpu", "cpu"):
        return None
    if not raw.isdigit() or int(raw) < 1:
        problems.append(f"PET_NPROC_PER_NODE={raw!r} is not a process count (a whole number, auto, gpu or cpu)")
        return None
    return int(raw)


def _number(env: Mapping[str, str], name: str, low: int, problems: list[str]) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < low:
        problems.append(f"environment variable {name}={raw!r} is not a whole number >= {low}")
        return None
    return int(raw)


def _rank_fits(rank: int, nnodes: int, rank_name: str, count_name: str, problems: list[str]) -> None:
    if rank >= nnodes:
        problems.append(f"{rank_name}={rank} must be below {count_name} ({nnodes})")


def _sources(env: Mapping[str, str], **names: str) -> dict[str, str]:
    """Our variable -> "THEIRS=value" for the variables that are set (named in contradiction messages)."""
    return {ours: f"{theirs}={env[theirs]}" for ours, theirs in names.items() if env.get(theirs)}
