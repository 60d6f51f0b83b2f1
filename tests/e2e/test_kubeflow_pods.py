"""Pods of a Kubeflow job, played by processes on loopback with the variables the operator sets, train as one job.

The PyTorchJob case is the documented hang: the operator's RANK is the pod's index and WORLD_SIZE counts pods x
processes, so a pod that took them as its own rank and world size would wait forever for ranks nobody starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env
from tests.nodes import free_port_pair, run_nodes

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]
TRAINING = ("examples/tiny/sft_full.yaml", "max_steps=4", "logging_steps=1", "save_strategy=no", "do_eval=false",
            "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=64", "per_device_train_batch_size=2")
K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def pytorchjob_env(pod: int, pods: int, nproc: int, port: int) -> dict[str, str]:
    """training-operator v1.9 (envvar.go) for pod ``pod`` of a job with a Master and pods-1 Workers."""
    name = "job-master-0" if pod == 0 else f"job-worker-{pod - 1}"
    return {**K8S, "HOSTNAME": name, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(pods * nproc), "RANK": str(pod), "PET_NODE_RANK": str(pod),
            "PET_NPROC_PER_NODE": str(nproc), "PET_NNODES": str(pods), "PYTHONUNBUFFERED": "0"}


def trainjob_env(pod: int, pods: int, nproc: int, port: int) -> dict[str, str]:
    """Kubeflow Trainer's torch plugin (torch.go) for node ``pod``."""
    return {**K8S, "HOSTNAME": f"job-node-0-{pod}", "PET_NNODES": str(pods), "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(pod), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}


@pytest.mark.parametrize("flavour, pods, nproc", [(pytorchjob_env, 2, 2), (trainjob_env, 2, 1)],
                         ids=["pytorchjob-2x2", "trainjob-2x1"])
def test_operator_pods_train_as_one_job(flavour, pods, nproc, tiny_model_dir, tmp_path: Path):
    port = free_port_pair()
    argv = [sys.executable, "-m", "shardtune", "train", *TRAINING, f"model_name_or_path={tiny_model_dir}",
            f"output_dir={tmp_path}", "ddp_timeout=120"]
    pods_run = run_nodes([argv] * pods, [cli_env(GLOO_SOCKET_IFNAME="lo", **flavour(pod, pods, nproc, port))
                                         for pod in range(pods)], tmp_path.parent / f"{tmp_path.name}-pods", 500,
                         cwd=REPO)
    assert [code for code, _, _ in pods_run] == [0] * pods, pods_run[0][2][-3000:] + pods_run[1][2][-3000:]
    assert f"--nnodes={pods} --node-rank=1 --master-addr=127.0.0.1 --master-port={port}" in pods_run[1][1]
    results = json.loads((tmp_path / "train_results.json").read_text())
    assert (results["world_size"], results["global_step"], results["engine"]) == (pods * nproc, 4, "ddp")
    assert (tmp_path / "model.safetensors").is_file()
