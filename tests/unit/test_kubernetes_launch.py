"""Kubeflow pods: each operator flavour's variables -> nodes, node rank, processes; manifests vs. the CRD schemas."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from shardtune.errors import ConfigError
from shardtune.launch.env import inside_launcher, read_launch_env
from shardtune.launch.k8s_manifest import ManifestRequest, build_manifest, job_name, manifest_text
from shardtune.launch.kubernetes import PYTORCHJOB, PYTORCHJOB_ELASTIC, TRAINJOB, operator_flavour
from shardtune.launch.node_resources import NodeResources, node_resources, parse_memory, resource_problems
from shardtune.launch.torchrun import build_torchrun_argv, plan_launch, worker_argv
from tests.conftest import run_cli
from tests.unit.kubeflow_schema import SCHEMAS, validate

PY = "/usr/bin/python3"
POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "HOSTNAME": "job-worker-0"}


def pytorchjob_pod(pods: int, pod_index: int, nproc: str | None = None) -> dict[str, str]:
    """What training-operator v1.9 sets on a PyTorchJob pod (pkg/controller.v1/pytorch/envvar.go).

    Without nprocPerNode (operators before 1.7 always): WORLD_SIZE counts pods, no PET_* variables.
    """
    env = {**POD, "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "RANK": str(pod_index),
           "PYTHONUNBUFFERED": "0"}
    if nproc is None:
        return {**env, "WORLD_SIZE": str(pods)}
    per_pod = int(nproc) if nproc.isdigit() else 1
    return {**env, "WORLD_SIZE": str(pods * per_pod), "PET_NODE_RANK": str(pod_index),
            "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(pods)}


def trainjob_pod(pods: int, index: int, nproc: str = "4") -> dict[str, str]:
    """What Kubeflow Trainer's torch plugin sets (pkg/runtime/framework/plugins/torch/torch.go)."""
    return {**POD, "PET_NNODES": str(pods), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}


def elastic_pod(index: int, master: bool = False) -> dict[str, str]:
    """A PyTorchJob with an elasticPolicy (pkg/controller.v1/pytorch/elastic.go); workers only, unless ``master``."""
    env = {**POD, "PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "2", "PET_RDZV_BACKEND": "c10d",
           "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_RDZV_ID": "job", "PET_MAX_RESTARTS": "3"}
    return {**pytorchjob_pod(3, index, "2"), **env} if master else env


def argv_for(env: dict[str, str], gpus: int = 0) -> list[str]:
    plan = plan_launch(read_launch_env(env), visible_gpus=gpus)
    return build_torchrun_argv(plan, plan.node_rank, worker_argv("c.json"), PY)


def test_flavours_are_recognised():
    assert operator_flavour(pytorchjob_pod(2, 1)) == PYTORCHJOB
    assert operator_flavour(pytorchjob_pod(2, 1, "4")) == PYTORCHJOB
    assert operator_flavour(trainjob_pod(2, 1)) == TRAINJOB
    assert operator_flavour(elastic_pod(0)) == PYTORCHJOB_ELASTIC
    assert operator_flavour(POD) is None  # a plain pod: nothing to map
    # RANK and WORLD_SIZE typed by hand in some pod (a CI runner, say) keep their usual meaning.
    assert operator_flavour({**POD, "HOSTNAME": "runner-x7", "RANK": "0", "WORLD_SIZE": "1"}) is None
    assert operator_flavour({**pytorchjob_pod(2, 1), "HOSTNAME": "runner-x7"}) is None
    # The same variables outside Kubernetes are a hand-made setup, read as always.
    assert operator_flavour({k: v for k, v in pytorchjob_pod(2, 1).items() if not k.startswith("KUBERNETES")}) is None


@pytest.mark.parametrize("pods", [1, 2, 3, 4])
def test_old_pytorchjob_rank_is_the_pod_index_not_a_process_rank(pods):
    for index in range(pods):
        env = pytorchjob_pod(pods, index)
        # RANK and WORLD_SIZE are the pod's: shardtune must launch, not act as one rank of WORLD_SIZE.
        assert not inside_launcher(env)
        launch = read_launch_env(env)
        assert (launch.nnodes, launch.node_rank, launch.scheduler) == (pods, index, "PyTorchJob")
        assert argv_for(env, gpus=8) == [PY, "-m", "shardtune.launch.torchrun_agent", "--nproc-per-node=8",
                                         f"--nnodes={pods}",
                                         f"--node-rank={index}", "--master-addr=job-master-0", "--master-port=23456",
                                         "-m", "shardtune.train", "c.json"]


@pytest.mark.parametrize("nproc, expected", [("4", 4), ("auto", 8), ("gpu", 8)])
def test_pytorchjob_with_nproc_per_node(nproc, expected):
    # WORLD_SIZE = pods x nprocPerNode here; read as pods it would be a 4x too large node count.
    env = pytorchjob_pod(2, 1, nproc)
    launch = read_launch_env(env)
    plan = plan_launch(launch, visible_gpus=8)
    assert (plan.nnodes, plan.node_rank, plan.nproc_per_node, plan.world_size) == (2, 1, expected, 2 * expected)


def test_pytorchjob_without_pet_nnodes_counts_pods_from_world_size():
    env = {k: v for k, v in pytorchjob_pod(3, 2, "4").items() if k != "PET_NNODES"}
    assert read_launch_env(env).nnodes == 3


def test_torchrun_ranks_inside_the_pod_are_ranks():
    rank = {**pytorchjob_pod(2, 1, "2"), "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
            "TORCHELASTIC_RUN_ID": "none"}
    assert inside_launcher(rank)
    assert operator_flavour(rank) is None


@pytest.mark.parametrize("pods", [1, 2, 4])
def test_trainjob(pods):
    for index in range(pods):
        env = trainjob_pod(pods, index)
        assert not inside_launcher(env)
        assert argv_for(env) == [PY, "-m", "shardtune.launch.torchrun_agent", "--nproc-per-node=4", f"--nnodes={pods}",
                                 f"--node-rank={index}", "--master-addr=job-node-0-0.job", "--master-port=29400",
                                 "-m", "shardtune.train", "c.json"]


def test_trainjob_auto_processes_follow_the_gpus():
    assert plan_launch(read_launch_env(trainjob_pod(2, 0, "auto")), visible_gpus=2).nproc_per_node == 2


@pytest.mark.parametrize("master", [False, True])
def test_elastic_pytorchjob_uses_its_c10d_endpoint(master):
    argv = argv_for(elastic_pod(1, master))
    assert argv[3:9] == ["--nproc-per-node=2", "--nnodes=1:3", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=job-worker-0:23456", "--rdzv-id=job", "--max-restarts=3"]


@pytest.mark.parametrize("env, both", [
    # The classic hang: a NODE_RANK set by hand next to the operator's RANK.
    ({**pytorchjob_pod(2, 1), "NODE_RANK": "0"}, ("NODE_RANK=0", "RANK=1")),
    ({**pytorchjob_pod(2, 1), "NNODES": "4"}, ("NNODES=4", "WORLD_SIZE=2")),
    ({**trainjob_pod(2, 1), "MASTER_ADDR": "10.0.0.1"}, ("MASTER_ADDR=10.0.0.1", "PET_MASTER_ADDR=job-node-0-0.job")),
    ({**trainjob_pod(2, 1), "NPROC_PER_NODE": "2"}, ("NPROC_PER_NODE=2", "PET_NPROC_PER_NODE=4")),
    ({**pytorchjob_pod(2, 1, "4"), "PET_NODE_RANK": "0"}, ("PET_NODE_RANK=0", "RANK=1")),
    ({**pytorchjob_pod(2, 1, "4"), "WORLD_SIZE": "5"}, ("WORLD_SIZE=5", "pods x processes")),
])
def test_contradictions_are_one_line_naming_both_values(env, both):
    with pytest.raises(ConfigError) as err:
        read_launch_env(env)
    assert len(err.value.problems) == 1, err.value.problems
    assert all(part in err.value.problems[0] for part in both), err.value.problems[0]


def test_matching_user_variables_are_fine():
    assert read_launch_env({**pytorchjob_pod(2, 1, "4"), "NODE_RANK": "1", "NPROC_PER_NODE": "4"}).node_rank == 1


def manifest_request(kind: str, nodes: int = 2, gpus: int = 4, nproc: int = 4) -> ManifestRequest:
    return ManifestRequest(name="sft-run", config_name="sft.yaml", config_text="stage: sft\nmax_steps: 3\n",
                           overrides=("max_steps=5",), nodes=nodes, gpus_per_node=gpus, nproc_per_node=nproc,
                           image="registry.example/shardtune:0.1", kind=kind, namespace="ml")


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("nodes, gpus, nproc", [(1, 8, 8), (2, 4, 4), (4, 0, 2)])
def test_manifest_passes_the_crd_schema(kind, nodes, gpus, nproc):
    docs = list(yaml.safe_load_all(manifest_text(manifest_request(kind, nodes, gpus, nproc))))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob" if kind == "pytorchjob" else "TrainJob"]
    for doc in docs:
        assert validate(doc, SCHEMAS[doc["kind"]]) == []
    assert docs[0]["data"]["sft.yaml"] == "stage: sft\nmax_steps: 3\n"


def test_schema_check_catches_a_wrong_field():
    job = build_manifest(manifest_request("trainjob"))[1]
    job["spec"]["podSpecOverrides"] = []  # Trainer v2.0's name; v2.3 has runtimePatches
    job["spec"]["trainer"]["numNodes"] = "2"
    assert validate(job, SCHEMAS["TrainJob"]) == [".spec.trainer.numNodes: '2' is not of type integer",
                                                  ".spec.podSpecOverrides: unknown field"]


def test_pytorchjob_manifest_shape():
    job = build_manifest(manifest_request("pytorchjob", nodes=3))[1]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"  # the operator looks for this name
    assert container["command"] == ["shardtune", "train", "/etc/shardtune/sft.yaml", "max_steps=5"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert job["spec"]["nprocPerNode"] == "4"
    assert "Worker" not in build_manifest(manifest_request("pytorchjob", nodes=1))[1]["spec"]["pytorchReplicaSpecs"]


def test_trainjob_manifest_mounts_the_config_on_the_runtime_node():
    job = build_manifest(manifest_request("trainjob"))[1]
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    assert (job["spec"]["trainer"]["numNodes"], job["spec"]["trainer"]["numProcPerNode"]) == (2, 4)
    replicated = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert replicated["name"] == "node" and pod["containers"][0]["name"] == "node"
    assert pod["volumes"][0]["configMap"]["name"] == "sft-run-config"
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/etc/shardtune"


@pytest.mark.skipif(not os.environ.get("SHARDTUNE_KUBEFLOW_CRDS"),
                    reason="set SHARDTUNE_KUBEFLOW_CRDS to a folder with kubeflow.org_pytorchjobs.yaml (training-"
                           "operator v1.9) and trainer.kubeflow.org_trainjobs.yaml (trainer v2.3) for the full CRDs")
@pytest.mark.parametrize("kind, crd", [("pytorchjob", "kubeflow.org_pytorchjobs.yaml"),
                                       ("trainjob", "trainer.kubeflow.org_trainjobs.yaml")])
def test_manifest_passes_the_full_upstream_crd(kind, crd):
    definition = yaml.safe_load((Path(os.environ["SHARDTUNE_KUBEFLOW_CRDS"]) / crd).read_text())
    schema = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    job = build_manifest(manifest_request(kind))[1]
    assert validate(job, schema) == []


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_every_pod_requests_cpus_and_memory_and_mounts_shm(kind):
    """Without requests a pod lands anywhere and is evicted first; without /dev/shm NCCL and DataLoader workers
    have a container's 64 MiB."""
    resources = NodeResources(cpus=48, memory=300 * 2**30)
    job = build_manifest(replace(manifest_request(kind, gpus=8, nproc=8), resources=resources))[1]
    if kind == "pytorchjob":
        pods = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
        requests = [pod["containers"][0]["resources"] for pod in pods]
    else:
        replicated = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        pods = [replicated[0]["template"]["spec"]["template"]["spec"]]
        requests = [job["spec"]["trainer"]["resourcesPerNode"]]
    for got in requests:
        assert got == {"requests": {"cpu": "48", "memory": "300Gi"}, "limits": {"nvidia.com/gpu": 8}}
    for pod in pods:
        shm = [v for v in pod["volumes"] if v.get("emptyDir") == {"medium": "Memory"}]
        assert len(shm) == 1
        assert {"name": shm[0]["name"], "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    assert validate(job, SCHEMAS[job["kind"]]) == []


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_pods_get_the_time_to_save_before_sigkill(kind):
    """terminationGracePeriodSeconds = the computed warning time, on every pod (TrainJob: through the patch)."""
    req = replace(manifest_request(kind, nodes=3), grace_seconds=600, grace_source="--grace-seconds")
    job = build_manifest(req)[1]
    if kind == "pytorchjob":
        pods = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    else:
        replicated = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        pods = [replicated[0]["template"]["spec"]["template"]["spec"]]
    assert [pod["terminationGracePeriodSeconds"] for pod in pods] == [600] * len(pods)
    assert validate(job, SCHEMAS[job["kind"]]) == []
    assert "A deleted pod has 600 s after SIGTERM to save (--grace-seconds), then exits 143" in manifest_text(req)


def test_pytorchjob_restarts_a_preempted_pod_but_not_a_bad_config():
    """restartPolicy ExitCode: the training-operator (v1.7-v1.9, IsRetryableExitCode) recreates a pod that exited
    128-255 (143: stopped after saving) and fails the job on 1-127 (a config error exits 2), where OnFailure would
    restart a bad config forever."""
    replicas = build_manifest(manifest_request("pytorchjob", nodes=3))[1]["spec"]["pytorchReplicaSpecs"]
    assert {r["restartPolicy"] for r in replicas.values()} == {"ExitCode"}


def test_node_resources_defaults_and_flags():
    assert node_resources(None, None, 4, 10 * 2**30) == NodeResources(32, int(12.5 * 2**30), "estimate")
    assert node_resources(None, None, 2, None) == NodeResources(16, 64 * 2**30, "default")
    assert node_resources(None, None, 1, 2**20).memory == 8 * 2**30  # never below one rank's runtime
    assert node_resources(12, "200G", 8, 10).k8s_requests() == {"cpu": "12", "memory": "200Gi"}
    assert node_resources(12, "0", 8, 10).k8s_requests() == {"cpu": "12"}
    assert parse_memory("512Mi") == 512 * 2**20 and parse_memory("1.5T") == int(1.5 * 2**40)
    assert resource_problems(0, "lots") == ["--cpus-per-node must be >= 1 (got 0)",
                                            "--memory-per-node 'lots' is not a size; give e.g. 200G or 512Gi"]


def test_job_names_are_dns_labels():
    assert job_name(Path("examples/train_full/Llama3_SFT.yaml")) == "llama3-sft"
    assert job_name(Path("2024_run.yaml")) == "run"


def test_k8s_command_writes_a_manifest(tmp_path, tiny_model_dir):
    out = tmp_path / "job.yaml"
    done = run_cli("k8s", "examples/tiny/sft_full.yaml", "--nodes", "2", "--gpus-per-node", "0",
                   "--nproc-per-node", "2", "--image", "shardtune:dev", "--kind", "trainjob", "--out", str(out),
                   f"model_name_or_path={tiny_model_dir}", "max_steps=3")
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(out.read_text()))
    assert [validate(d, SCHEMAS[d["kind"]]) for d in docs] == [[], []]
    assert docs[1]["spec"]["trainer"]["command"][-1] == "max_steps=3"
    # The tiny model's estimate is far below one rank's runtime: the floor, 8 CPUs per process.
    assert docs[1]["spec"]["trainer"]["resourcesPerNode"]["requests"] == {"cpu": "16", "memory": "8Gi"}
    assert "Each pod requests 16 CPUs and 8 GiB of memory (estimate)" in out.read_text()
    # No --grace-seconds: the tiny model's checkpoint, estimated, needs the minimum.
    patch = docs[1]["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert patch["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120
    assert "time to write a node's checkpoint, estimated" in out.read_text()
    done = run_cli("k8s", "examples/tiny/sft_full.yaml", "--nodes", "2", "--gpus-per-node", "0",
                   "--nproc-per-node", "2", "--image", "shardtune:dev", "--grace-seconds", "900", "--out", str(out),
                   f"model_name_or_path={tiny_model_dir}")
    assert done.returncode == 0, done.stderr
    job = list(yaml.safe_load_all(out.read_text()))[1]
    assert {r["template"]["spec"]["terminationGracePeriodSeconds"]
            for r in job["spec"]["pytorchReplicaSpecs"].values()} == {900}
    # The example overwrites its output_dir: a pod recreated after a preemption would delete the checkpoints.
    assert "overwrite_output_dir (true): a pod recreated after a preemption" in done.stderr
    done = run_cli("k8s", "examples/tiny/sft_full.yaml", "--nodes", "2", "--gpus-per-node", "0",
                   "--nproc-per-node", "2", "--image", "shardtune:dev", "--out", str(out),
                   f"model_name_or_path={tiny_model_dir}", "overwrite_output_dir=false")
    assert done.returncode == 0 and "overwrite_output_dir" not in done.stderr, done.stderr


def test_k8s_command_validates_the_config_first(tmp_path):
    done = run_cli("k8s", "examples/tiny/sft_full.yaml", "--nodes", "2", "--gpus-per-node", "0", "--image", "x",
                   "--out", str(tmp_path / "job.yaml"), "learning_rate=-1")
    assert done.returncode == 2 and "learning_rate" in done.stderr
    assert not (tmp_path / "job.yaml").exists()
