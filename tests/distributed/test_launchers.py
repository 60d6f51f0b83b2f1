"""The same training through every launcher users bring: torchrun, accelerate launch, deepspeed, 2 nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.launch.torchrun import find_free_port
from tests.conftest import REPO, cli_env
from tests.distributed.helpers import COMMON, check_saved_model, losses
from tests.nodes import free_port_pair, run_nodes

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
BIN = Path(sys.executable).parent


def training_args(model: Path, out: Path, micro: int = 2) -> list[str]:
    return [*COMMON, f"model_name_or_path={model}", f"output_dir={out}", "finetuning_type=full",
            f"per_device_train_batch_size={micro}"]


def run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=REPO, env=cli_env(GLOO_SOCKET_IFNAME="lo", **env), capture_output=True,
                            text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def engine_of(out: Path) -> tuple[str, int]:
    results = json.loads((out / "train_results.json").read_text())
    return results["engine"], results["world_size"]


def test_torchrun_module_entry(reference, tiny_model_dir, tmp_path):
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "shardtune.train", *training_args(tiny_model_dir, tmp_path)])
    assert engine_of(tmp_path) == ("ddp", 2)
    assert losses(tmp_path) == pytest.approx(reference["full"], rel=2e-3)


def test_torchrun_script_path_with_fsdp(reference, tiny_model_dir, tmp_path):
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "scripts/train.py",
         *training_args(tiny_model_dir, tmp_path), "fsdp=full_shard auto_wrap"])
    assert engine_of(tmp_path) == ("fsdp", 2)
    assert losses(tmp_path) == pytest.approx(reference["full"], rel=2e-3)


ACCELERATE = {
    "single_node.yaml": "ddp",
    "fsdp_config.yaml": "fsdp",
    "fsdp_config_offload.yaml": "fsdp",
    "fsdp2_config.yaml": "fsdp",
    "deepspeed_z3.yaml": "deepspeed",
}


@pytest.mark.parametrize("config_file", sorted(ACCELERATE))
def test_accelerate_launch_with_shipped_config(config_file, reference, tiny_model_dir, tmp_path):
    run([str(BIN / "accelerate"), "launch", "--config_file", f"examples/accelerate/{config_file}", "-m",
         "shardtune.train", *training_args(tiny_model_dir, tmp_path)])
    assert engine_of(tmp_path) == (ACCELERATE[config_file], 2)
    assert losses(tmp_path) == pytest.approx(reference["full"], rel=2e-3)
    check_saved_model(tmp_path, tiny_model_dir, "full")


def test_accelerate_multi_node_config_two_machines(reference, tiny_model_dir, tmp_path):
    port = str(free_port_pair())
    base = [str(BIN / "accelerate"), "launch", "--config_file", "examples/accelerate/multi_node.yaml",
            "--main_process_port", port]
    args = ["-m", "shardtune.train", *training_args(tiny_model_dir, tmp_path, micro=2)]
    env = cli_env(GLOO_SOCKET_IFNAME="lo")
    nodes = run_nodes([[*base, "--machine_rank", str(rank), *args] for rank in (0, 1)], [env, env],
                      tmp_path.parent / f"{tmp_path.name}-nodes", 500, cwd=REPO)
    assert [code for code, _, _ in nodes] == [0, 0], nodes[0][2][-3000:] + nodes[1][2][-3000:]
    assert engine_of(tmp_path) == ("ddp", 2)
    assert losses(tmp_path) == pytest.approx(reference["full"], rel=2e-3)


def test_deepspeed_launcher_injects_local_rank(reference, tiny_model_dir, tmp_path):
    run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(find_free_port()), "scripts/train.py",
         *training_args(tiny_model_dir, tmp_path), "deepspeed=z2"])
    assert engine_of(tmp_path) == ("deepspeed", 2)
    assert losses(tmp_path) == pytest.approx(reference["full"], rel=2e-3)


def test_two_nodes_through_shardtune_train(reference, tiny_model_dir, tmp_path):
    """Two `shardtune train` invocations (NNODES=2, NODE_RANK=0/1) on loopback train as one job."""
    port = str(free_port_pair())
    env = cli_env(NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    # With a tokenised-data cache: rank 0 builds it, the other node's first rank finds it on the shared disk.
    argv = [sys.executable, "-m", "shardtune", "train", *training_args(tiny_model_dir, tmp_path, micro=2),
            f"tokenized_path={tmp_path / 'tokenized'}"]
    nodes = run_nodes([argv, argv], [{**env, "NODE_RANK": str(rank)} for rank in (0, 1)],
                      tmp_path.parent / f"{tmp_path.name}-nodes", 500, cwd=REPO)
    assert [code for code, _, _ in nodes] == [0, 0], nodes[0][2][-3000:] + nodes[1][2][-3000:]
    assert engine_of(tmp_path) == ("ddp", 2)
    assert losses(tmp_path) == pytest.approx(reference["full"], rel=2e-3)
    assert (tmp_path / "tokenized" / "shardtune_data.json").is_file()
    assert "tokenising into" in nodes[0][1] and "tokenising into" not in nodes[1][1]


def test_node_that_never_joins_ends_the_job_within_the_timeout(tiny_model_dir, tmp_path):
    import time

    env = cli_env(NNODES="2", NODE_RANK="0", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port_pair()), RDZV_TIMEOUT="10")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "shardtune", "train", *training_args(tiny_model_dir, tmp_path)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert time.monotonic() - start < 60
    # The node check (launch/nodes.py) names the missing node before torchrun starts.
    errors = [x for x in result.stderr.splitlines() if x.startswith("shardtune: error:")]
    assert len(errors) == 1 and "node(s) 1 of 2 never arrived within 1" in errors[0], result.stderr[-3000:]
    assert "launching:" not in result.stdout
