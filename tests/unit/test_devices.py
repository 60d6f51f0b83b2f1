"""GPUs per process: what the launching host counts, what it refuses before launch, which GPU each rank takes.

Device counts are given to the pure functions (or patched where the launching host asks), so these run on a CPU
machine: a node that starts more processes than it sees GPUs, srun's --gpus-per-task=1 (each process sees one GPU
whatever its LOCAL_RANK), and a CUDA_VISIBLE_DEVICES left in the environment of a machine without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from shardtune.engines.distributed import rank_device
from shardtune.errors import ConfigError
from shardtune.host import installed_gpu_count, visible_entries, visible_gpu_count
from shardtune.launch import preflight as preflight_module
from shardtune.launch.env import LaunchEnv
from shardtune.launch.torchrun import device_problems, plan_launch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(installed_gpu_count() > 0, reason="this machine has GPUs")
def test_cuda_visible_devices_counts_nothing_on_a_machine_without_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert visible_gpu_count() == 0


def test_visible_devices_are_read_as_cuda_reads_them(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu_count("0,1", installed=0) == 0
    assert visible_gpu_count("0,1", installed=8) == 2
    assert visible_gpu_count(installed=4) == 4  # unset: every installed GPU
    assert visible_gpu_count("", installed=4) == 0  # set but empty: none
    assert visible_entries("0,-1,1", 4) == ["0"]  # CUDA stops at the first entry that names no device
    assert visible_entries("3,1", 2) == []  # index 3 does not exist on a 2-GPU machine
    assert visible_entries("1,1,2", 4) == ["1"]  # a repeat ends the list too
    assert visible_entries("GPU-8f2a,GPU-77c1", 2) == ["GPU-8f2a", "GPU-77c1"]


def plan(nproc: int | None, **changes):
    return plan_launch(LaunchEnv(nproc_per_node=nproc, **changes), visible_gpus=1, free_port=29500)


def test_more_processes_than_gpus_is_refused_before_launch():
    [line] = device_problems(plan(8, scheduler="SLURM"), visible_gpus=1, visible_setting="3", scheduler="SLURM")
    assert line.startswith("NPROC_PER_NODE=8 starts 8 processes on this node, but it sees 1 GPU(s) "
                           "(CUDA_VISIBLE_DEVICES=3)")
    assert "--gpus-per-node=N`, not --gpus-per-task=1" in line and "NPROC_PER_NODE=1" in line
    assert device_problems(plan(2), visible_gpus=2, visible_setting=None) == []
    assert device_problems(plan(2), visible_gpus=4, visible_setting=None) == []
    assert device_problems(plan(4), visible_gpus=0, visible_setting="0,1") == []  # CPU ranks: any number
    assert device_problems(plan(4, use_ray=True), visible_gpus=1, visible_setting=None) == []  # Ray places them


def test_plan_run_names_nproc_per_node_with_the_other_problems(tiny_model_dir, tmp_path, monkeypatch):
    config = {"model_name_or_path": str(tiny_model_dir), "dataset": "demo", "dataset_dir": str(REPO / "data"),
              "template": "chatml", "output_dir": str(tmp_path / "run"), "max_steps": 2, "learning_rate": -1}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    monkeypatch.setattr(preflight_module, "visible_gpu_count", lambda: 2)
    monkeypatch.setattr(preflight_module, "cuda_visible_devices", lambda: "0,1")
    with pytest.raises(ConfigError) as caught:
        preflight_module.plan_run([str(path)])
    problems = "\n".join(caught.value.problems)
    assert "NPROC_PER_NODE=4 starts 4 processes on this node, but it sees 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1)" \
        in problems
    assert "learning_rate" in problems  # in the same round


def test_each_rank_takes_the_gpu_it_can_see():
    assert rank_device(0, 0) == torch.device("cpu")
    assert rank_device(3, 8) == torch.device("cuda", 3)
    # srun --gpus-per-task=1 (or a GPU per container): LOCAL_RANK 5 sees one GPU, which is its own.
    assert rank_device(5, 1) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=5 sees 4 GPUs.*at most 4 processes"):
        rank_device(5, 4)


def test_deepspeed_refuses_a_rank_given_another_gpu_than_its_local_rank():
    from shardtune.engines.base import PrecisionSettings
    from shardtune.engines.deepspeed import DeepSpeedEngine
    from shardtune.engines.distributed import DistContext

    ctx = DistContext(rank=5, local_rank=5, world_size=8, local_world_size=8, device=torch.device("cuda", 0),
                      backend="cpu:gloo,cuda:nccl")
    with pytest.raises(ConfigError, match="DeepSpeed always takes the GPU numbered LOCAL_RANK"):
        DeepSpeedEngine.from_plan(None, None, ctx, PrecisionSettings())  # type: ignore[arg-type]
