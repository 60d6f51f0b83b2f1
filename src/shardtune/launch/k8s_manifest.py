"""`shardtune k8s`: validate a config, then write a Kubeflow manifest that trains it on N pods.

Two kinds, both with the config file in a ConfigMap mounted at /etc/shardtune:
- PyTorchJob (kubeflow.org/v1, training-operator): a Master replica and N-1 Workers, container "pytorch".
- TrainJob (trainer.kubeflow.org/v1alpha1, Kubeflow Trainer v2.3): the `torch-distributed` runtime, numNodes
  pods, the config mounted through runtimePatches on the runtime's "node" job and container.
Each pod runs `shardtune train /etc/shardtune/<config>`; launch/kubernetes.py reads what the operator sets.
Each pod requests CPUs and memory (launch/node_resources.py) and mounts a memory-backed /dev/shm: a container's
default 64 MiB is too little for NCCL with several GPUs per pod and for DataLoader workers.

Preemption: a deleted or evicted pod gets SIGTERM, then SIGKILL after ``terminationGracePeriodSeconds`` (set to the
time the estimated checkpoint needs, or ``--grace-seconds``); the ranks finish the step, save and exit
``REQUEUE_EXIT_CODE`` (143). PyTorchJob replicas use the training-operator's ``restartPolicy: ExitCode``, which
recreates a pod that exited 128-255 (143: stopped after saving; 137: killed) and fails the job on 1-127 (a config
error exits 2), where ``OnFailure`` would restart a bad config forever (pkg/util/train/train_util.go,
``IsRetryableExitCode``, training-operator v1.7-v1.9). A TrainJob restarts as its runtime's JobSet failure policy says.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardtune.arguments import CommandParser
from shardtune.errors import ConfigError
from shardtune.launch.cluster import add_node_shape_arguments, node_shape_problems, processes_per_node
from shardtune.launch.node_resources import (
    UNSIZED_CHECKPOINT,
    NodeResources,
    add_resource_arguments,
    estimated_checkpoint_bytes,
    estimated_node_memory,
    estimated_option,
    node_resources,
    resource_problems,
    stop_warning,
)
from shardtune.launch.preemption import REQUEUE_EXIT_CODE, warning_seconds
from shardtune.paths import output_file_problem
from shardtune.world import WorldLayout

KINDS = ("pytorchjob", "trainjob")
MOUNT_DIR = "/etc/shardtune"
VOLUME = "shardtune-config"
SHM_VOLUME, SHM_DIR = "dshm", "/dev/shm"
GPU_RESOURCE = "nvidia.com/gpu"
TRAINJOB_RUNTIME = "torch-distributed"
# Kubeflow's names: PyTorchJob's container must be "pytorch"; the torch runtime's job and container are "node".
PYTORCH_CONTAINER, TRAINJOB_NODE = "pytorch", "node"
# The training-operator recreates a pod that exited 128-255 and fails the job on 1-127 (module docstring).
RESTART_POLICY = "ExitCode"


@dataclass(frozen=True)
class ManifestRequest:
    name: str
    config_name: str
    config_text: str
    overrides: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    nproc_per_node: int
    image: str
    kind: str = "pytorchjob"
    namespace: str | None = None
    resources: NodeResources = field(default_factory=lambda: NodeResources(cpus=8, memory=32 * 2**30))
    # Seconds between SIGTERM and SIGKILL when a pod is deleted: the ranks' time to save (and where it came from).
    grace_seconds: int = warning_seconds(0)
    grace_source: str = UNSIZED_CHECKPOINT

    @property
    def world_size(self) -> int:
        return WorldLayout(self.nodes, self.nproc_per_node).world_size

    @property
    def train_command(self) -> list[str]:
        return ["shardtune", "train", f"{MOUNT_DIR}/{self.config_name}", *self.overrides]


def build_manifest(req: ManifestRequest) -> list[dict[str, Any]]:
    """The ConfigMap and the job (pure); ``yaml.safe_dump_all`` writes them as one file."""
    job = build_pytorchjob(req) if req.kind == "pytorchjob" else build_trainjob(req)
    return [build_configmap(req), job]


def build_configmap(req: ManifestRequest) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(req, f"{req.name}-config"),
            "data": {req.config_name: req.config_text}}


def build_pytorchjob(req: ManifestRequest) -> dict[str, Any]:
    replicas = {"Master": _pytorch_replica(req, 1)}
    if req.nodes > 1:
        replicas["Worker"] = _pytorch_replica(req, req.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(req, req.name),
        # Operator >= 1.7 then sets WORLD_SIZE = pods x nprocPerNode and PET_NPROC_PER_NODE; older ones count pods.
        # shardtune reads either (launch/kubernetes.py).
        "spec": {"nprocPerNode": str(req.nproc_per_node), "pytorchReplicaSpecs": replicas},
    }


def _pytorch_replica(req: ManifestRequest, replicas: int) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": PYTORCH_CONTAINER, "image": req.image, "command": req.train_command,
        # Also tells operators older than 1.7, which set no PET_NPROC_PER_NODE, how many ranks each pod starts.
        "env": [{"name": "NPROC_PER_NODE", "value": str(req.nproc_per_node)}],
        "volumeMounts": _volume_mounts(), "resources": _resources(req),
    }
    pod = {"containers": [container], "volumes": _volumes(req), "terminationGracePeriodSeconds": req.grace_seconds}
    return {"replicas": replicas, "restartPolicy": RESTART_POLICY, "template": {"spec": pod}}


def build_trainjob(req: ManifestRequest) -> dict[str, Any]:
    trainer: dict[str, Any] = {"image": req.image, "command": req.train_command, "numNodes": req.nodes,
                               "numProcPerNode": req.nproc_per_node, "resourcesPerNode": _resources(req)}
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _metadata(req, req.name),
        "spec": {"runtimeRef": {"name": TRAINJOB_RUNTIME}, "trainer": trainer,
                 "runtimePatches": [_config_mount_patch(req)]},
    }


def _config_mount_patch(req: ManifestRequest) -> dict[str, Any]:
    """Trainer v2.3's runtimePatches: the ConfigMap and /dev/shm volumes and their mounts on the runtime's "node"
    job and container, and the pods' termination grace period (a field of v2.3's PodSpecPatch).

    (Trainer v2.0 called this podSpecOverrides and v2.1 podTemplateOverrides, with other shapes.)
    """
    pod = {"volumes": _volumes(req), "containers": [{"name": TRAINJOB_NODE, "volumeMounts": _volume_mounts()}],
           "terminationGracePeriodSeconds": req.grace_seconds}
    job = {"name": TRAINJOB_NODE, "template": {"spec": {"template": {"spec": pod}}}}
    return {"manager": "shardtune", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}}}


def _metadata(req: ManifestRequest, name: str) -> dict[str, Any]:
    return {"name": name, **({"namespace": req.namespace} if req.namespace else {})}


def _resources(req: ManifestRequest) -> dict[str, Any]:
    """CPU and memory requested (the scheduler places the pod where they are free; no limit, so a rank that needs
    more for a moment is not killed), GPUs as a limit (extended resources are requested by their limit)."""
    resources: dict[str, Any] = {"requests": req.resources.k8s_requests()}
    if req.gpus_per_node:
        resources["limits"] = {GPU_RESOURCE: req.gpus_per_node}
    return resources


def _volumes(req: ManifestRequest) -> list[dict[str, Any]]:
    # /dev/shm in memory, counted against the pod's memory: NCCL's intra-node buffers, DataLoader workers.
    return [{"name": VOLUME, "configMap": {"name": f"{req.name}-config"}},
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]


def _volume_mounts() -> list[dict[str, Any]]:
    return [{"name": VOLUME, "mountPath": MOUNT_DIR, "readOnly": True}, {"name": SHM_VOLUME, "mountPath": SHM_DIR}]


def manifest_text(req: ManifestRequest) -> str:
    import yaml

    header = (f"# Written by `shardtune k8s`: {req.kind} {req.name}, {req.nodes} pod(s) x {req.nproc_per_node} "
              f"process(es) = {req.world_size} rank(s).\n# Each pod requests {req.resources.describe()}; output_dir "
              f"must be on a volume every pod mounts (docs/clusters.md).\n# {_preemption_comment(req)}\n"
              "# Apply with `kubectl apply -f THIS_FILE`. "
              "The image must contain shardtune, the model and the data the config names.\n")
    return header + yaml.dump_all(build_manifest(req), Dumper=_block_dumper(), sort_keys=False)


def _preemption_comment(req: ManifestRequest) -> str:
    restart = ("the operator recreates the pod (restartPolicy ExitCode), which resumes from the newest complete "
               "checkpoint" if req.kind == "pytorchjob" else "the runtime's failure policy decides whether it restarts")
    return (f"A deleted pod has {req.grace_seconds} s after SIGTERM to save ({req.grace_source}), then exits "
            f"{REQUEUE_EXIT_CODE}:\n# {restart}.")


def _block_dumper():
    """A safe YAML dumper that writes multi-line strings (the config file) as readable `|` blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return Dumper


def job_name(config: Path) -> str:
    """An RFC 1035 label (what both CRDs require) from the config's file name."""
    label = re.sub(r"[^a-z0-9-]+", "-", config.stem.lower()).strip("-")
    label = re.sub(r"^[^a-z]+", "", label)
    return (label or "shardtune")[:50].rstrip("-")


def k8s_command(args: list[str]) -> int:
    """`shardtune k8s CONFIG --nodes N --gpus-per-node G --image IMG [...] [key=value ...]`."""
    from shardtune.config.args import parse_subcommand
    from shardtune.launch.preflight import preflight

    parser = CommandParser(prog="shardtune k8s", description="Validate CONFIG and write a Kubeflow "
                                     "manifest (ConfigMap + PyTorchJob or TrainJob) that trains it on N pods.")
    add_node_shape_arguments(parser, "pod")
    add_resource_arguments(parser, "pod")
    parser.add_argument("--image", required=True, help="container image with shardtune installed")
    parser.add_argument("--kind", choices=KINDS, default="pytorchjob")
    parser.add_argument("--namespace")
    parser.add_argument("--name", help="job name (default: from the config file name)")
    parser.add_argument("--grace-seconds", type=int, dest="grace_seconds",
                        help="seconds a deleted pod has after SIGTERM to save before SIGKILL "
                             "(terminationGracePeriodSeconds; default: the estimated checkpoint's write time, at "
                             "least 120)")
    parser.add_argument("--out", help="file to write (default: <config name>.<kind>.yaml here)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    ns, overrides = parse_subcommand(parser, args)
    req = manifest_request(ns, overrides)
    plan = preflight([ns.config, *overrides], req.nodes, req.nproc_per_node)
    if plan.config.overwrite_output_dir:
        # A pod recreated after a preemption cannot tell it is a second attempt (Slurm's requeue can).
        print("shardtune: warning: overwrite_output_dir (true): a pod recreated after a preemption would start "
              "afresh and delete the run's checkpoints; set it to false for a job that may be preempted",
              file=sys.stderr)
    option = estimated_option(plan, req.gpus_per_node)
    seconds, source = stop_warning(ns.grace_seconds, "--grace-seconds", estimated_checkpoint_bytes(option))
    req = replace(req, resources=node_resources(ns.cpus_per_node, ns.memory_per_node, req.nproc_per_node,
                                                estimated_node_memory(option)),
                  grace_seconds=seconds, grace_source=source)
    out = Path(ns.out or f"{Path(ns.config).stem}.{req.kind}.yaml").resolve()
    problem = output_file_problem(out, "k8s: --out")
    if problem:
        raise ConfigError(problem)
    out.write_text(manifest_text(req))
    print(f"wrote {out} ({req.kind}, {req.nodes} pod(s) x {req.nproc_per_node} process(es))")
    return 0


def manifest_request(ns: argparse.Namespace, overrides: list[str]) -> ManifestRequest:
    problems = node_shape_problems(ns.nodes, ns.gpus_per_node, ns.nproc_per_node) + \
        resource_problems(ns.cpus_per_node, ns.memory_per_node)
    if ns.grace_seconds is not None and ns.grace_seconds < 1:
        problems.append(f"--grace-seconds must be >= 1 (got {ns.grace_seconds})")
    name = ns.name or job_name(Path(ns.config))
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 50:
        problems.append(f"--name {name!r} must be a DNS label: lower-case letters, digits and '-', starting "
                        "with a letter, at most 50 characters")
    config = Path(ns.config)
    if not config.is_file():
        problems.append(f"config file {config} does not exist")
    if problems:
        raise ConfigError(*problems)
    return ManifestRequest(
        name=name, config_name=config.name, config_text=config.read_text(), overrides=tuple(overrides),
        nodes=ns.nodes, gpus_per_node=ns.gpus_per_node,
        nproc_per_node=processes_per_node(ns.gpus_per_node, ns.nproc_per_node),
        image=ns.image, kind=ns.kind, namespace=ns.namespace)
