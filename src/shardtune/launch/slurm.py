"""SLURM allocations: node list, node count, node id, GPUs and job id -> a c10d torchrun launch on every node.

Pure functions over the variables launch/env.py hands over (it is the one module that reads the environment).
`srun shardtune train cfg.yaml` starts one shardtune per node; each starts torchrun with
``--rdzv-backend c10d --rdzv-endpoint <first host>:<port> --rdzv-id <job id>``, so torchrun numbers the nodes
itself and no node needs a NODE_RANK.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping

from shardtune.launch.cluster import ClusterLaunch

SCHEDULER = "SLURM"
# Rendezvous ports derived from the job id fall in this range, away from Slurm's own (6817-6819) and ephemeral ports.
PORT_BASE, PORT_SPAN = 20000, 10000


def in_allocation(env: Mapping[str, str]) -> bool:
    """Inside an sbatch/salloc/srun allocation (a job id and a node list are set)."""
    return bool(env.get("SLURM_JOB_ID")) and bool(_node_list_text(env))


def read_slurm_launch(env: Mapping[str, str]) -> tuple[ClusterLaunch | None, list[str]]:
    """The launch this node takes part in (None outside an allocation), with every problem found."""
    if not in_allocation(env):
        return None, []
    problems: list[str] = []
    nodes_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    try:
        hosts = expand_hostlist(_node_list_text(env))
    except ValueError as err:
        return None, [f"{nodes_var}={_node_list_text(env)!r} cannot be read: {err}"]
    count_var = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    nnodes = _whole_number(env, count_var, problems) or len(hosts)
    node_id = _whole_number(env, "SLURM_NODEID", problems) or 0
    if nnodes != len(hosts):
        problems.append(f"{count_var}={nnodes} but {nodes_var} lists {len(hosts)} hosts ({', '.join(hosts)})")
    try:
        problems += _task_problems(env, nnodes)
    except ValueError as err:
        problems.append(f"SLURM_STEP_TASKS_PER_NODE cannot be read: {err}")
    gpus, gpu_source = gpus_on_node(env)
    job_id = env["SLURM_JOB_ID"]
    sources = {"NNODES": f"{count_var}={nnodes}", "NODE_RANK": f"SLURM_NODEID={node_id}",
               "MASTER_ADDR": f"{nodes_var}={_node_list_text(env)}"}
    if gpu_source:
        sources["NPROC_PER_NODE"] = gpu_source
    launch = ClusterLaunch(scheduler=SCHEDULER, nnodes=nnodes, node_rank=node_id, master_addr=hosts[0],
                           master_port=port_for_job(job_id), nproc_per_node=gpus, rdzv_id=f"slurm-{job_id}",
                           c10d_rendezvous=True, sources=sources)
    return launch, problems


def port_for_job(job_id: str) -> int:
    """The same rendezvous port on every node of a job, without any node telling the others."""
    return PORT_BASE + zlib.crc32(job_id.encode()) % PORT_SPAN


def gpus_on_node(env: Mapping[str, str]) -> tuple[int | None, str | None]:
    """GPUs Slurm gave this node and the variable that says so; (None, None) without a GPU request (CPU jobs)."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        raw = env.get(name, "").strip()
        # --gpus-per-node=a100:4 and the gres form gpu:a100:4 both end in the count.
        count = raw.rsplit(":", 1)[-1]
        if count.isdigit() and int(count) > 0:
            return int(count), f"{name}={raw}"
    return None, None


def _task_problems(env: Mapping[str, str], nnodes: int) -> list[str]:
    """shardtune must run once per node: it starts that node's ranks itself. The remedy names no subcommand: check,
    estimate, doctor and eval read these variables too, and each is told to run under srun, not to run train."""
    if env.get("SLURM_STEP_ID") is None:
        if not env.get("SLURMD_NODENAME"):
            # An salloc shell on the login host: the job's variables are set, but this is not one of its nodes,
            # and the first node would wait for a rendezvous host that never starts.
            return [f"shardtune runs outside the nodes of Slurm job {env.get('SLURM_JOB_ID')} (no SLURMD_NODENAME: "
                    "an salloc shell?): start it on the nodes: put `srun --ntasks-per-node=1` in front of this "
                    "shardtune command"]
        # The batch script runs on the first node only.
        if nnodes > 1:
            return [f"this job has {nnodes} nodes but shardtune runs outside srun, on one node only: put `srun "
                    "--ntasks-per-node=1` in front of this shardtune command so that every node joins"]
        return []
    per_node = expand_counts(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1")
    if max(per_node, default=1) > 1:
        return [f"srun started {max(per_node)} shardtune tasks on a node (SLURM_STEP_TASKS_PER_NODE="
                f"{env.get('SLURM_STEP_TASKS_PER_NODE')}); shardtune starts each node's ranks itself: use "
                "`srun --ntasks-per-node=1`"]
    return []


def _node_list_text(env: Mapping[str, str]) -> str:
    return (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "").strip()


def _whole_number(env: Mapping[str, str], name: str, problems: list[str]) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        problems.append(f"environment variable {name}={raw!r} is not a whole number (set by Slurm; is it stale?)")
        return None
    return int(raw)


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order: ``node[01-03,07],gpu-a[1-2]`` -> node01 ... gpu-a2.

    Several bracket groups in one name (``rack[1-2]-n[1-2]``) expand like `scontrol show hostnames`:
    the last group varies fastest. Zero padding of a range's start is kept.
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(text.strip()):
        hosts += _expand_item(item)
    if not hosts:
        raise ValueError("no host names")
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ValueError("'[' without ']'")
    return [item for item in [*items, current] if item]


def _expand_item(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, rest = item[:match.start()], item[match.end():]
    return [prefix + number + tail for number in _expand_ranges(match.group(1)) for tail in _expand_item(rest)]


def _expand_ranges(text: str) -> list[str]:
    numbers: list[str] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"'{part}' is not a number or a range like 01-04")
        if not dash:
            numbers.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range '{part}' runs backwards")
        width = len(low)
        numbers += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return numbers


def expand_counts(text: str) -> list[int]:
    """Slurm's per-node counts: ``2(x3),1`` -> [2, 2, 2, 1] (SLURM_TASKS_PER_NODE and friends)."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"'{part}' is not a count like 2 or 2(x3)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
