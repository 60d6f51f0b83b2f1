"""SLURM: host lists, the job's variables -> the exact torchrun argv on each node, refusals, the sbatch script."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shardtune.errors import ConfigError
from shardtune.launch.env import inside_launcher, read_launch_env
from shardtune.launch.node_resources import NodeResources, stop_warning
from shardtune.launch.preemption import REQUEUE_EXIT_CODE
from shardtune.launch.sbatch import SbatchRequest, build_sbatch_script, parse_job_id
from shardtune.launch.slurm import expand_counts, expand_hostlist, port_for_job
from shardtune.launch.torchrun import build_torchrun_argv, plan_launch, worker_argv
from tests.conftest import run_cli

PY = "/usr/bin/python3"
HOSTLISTS = {
    "vm": ["vm"],
    "node[01-03,07],gpu-a[1-2]": ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"],
    "rack[1-2]-n[08-10]": ["rack1-n08", "rack1-n09", "rack1-n10", "rack2-n08", "rack2-n09", "rack2-n10"],
    "x[9-11],solo": ["x9", "x10", "x11", "solo"],
    "gpu[007]": ["gpu007"],
}


@pytest.mark.parametrize("text", list(HOSTLISTS))
def test_hostlist_expansion(text):
    assert expand_hostlist(text) == HOSTLISTS[text]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's scontrol is not installed")
@pytest.mark.parametrize("text", list(HOSTLISTS))
def test_hostlist_expansion_matches_scontrol(text, tmp_path):
    conf = tmp_path / "slurm.conf"  # scontrol needs some configuration, even to expand a host list
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=ALL\n")
    done = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True,
                          env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}, timeout=30)
    assert done.returncode == 0, done.stderr
    assert expand_hostlist(text) == done.stdout.split()


@pytest.mark.parametrize("text", ["node[01-", "node]1[", "node[a-b]", "node[3-1]", ""])
def test_bad_hostlist_is_named(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_task_counts():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("1") == [1]


def slurm_env(nodes: int, node_id: int, job: str = "4242", **extra: str) -> dict[str, str]:
    """What `srun --ntasks-per-node=1` sets on node ``node_id`` of an allocation of ``nodes`` nodes."""
    hosts = f"gpu[1-{nodes}]" if nodes > 1 else "gpu1"
    return {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": hosts, "SLURM_NNODES": str(nodes),
            "SLURM_NODEID": str(node_id), "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": hosts,
            "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_TASKS_PER_NODE": f"1(x{nodes})",
            "SLURM_PROCID": str(node_id), "SLURM_LOCALID": "0", "SLURMD_NODENAME": f"gpu{node_id + 1}", **extra}


def node_argv(env: dict[str, str]) -> list[str]:
    plan = plan_launch(read_launch_env(env), visible_gpus=0)
    return build_torchrun_argv(plan, plan.node_rank, worker_argv("run/cfg.json"), PY)


@pytest.mark.parametrize("nodes", [1, 2, 3, 4])
def test_every_node_gets_the_same_c10d_command(nodes):
    port = port_for_job("4242")
    expected = [PY, "-m", "shardtune.launch.torchrun_agent", "--nproc-per-node=8", f"--nnodes={nodes}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=gpu1:{port}", "--rdzv-id=slurm-4242",
                "-m", "shardtune.train", "run/cfg.json"]
    for node in range(nodes):
        env = slurm_env(nodes, node, SLURM_GPUS_ON_NODE="8")
        launch = read_launch_env(env)
        assert (launch.nnodes, launch.node_rank, launch.scheduler) == (nodes, node, "SLURM")
        assert node_argv(env) == expected


def test_gpu_count_sources_and_cpu_default():
    assert read_launch_env(slurm_env(2, 0, SLURM_GPUS_PER_NODE="a100:4")).nproc_per_node == 4
    assert read_launch_env(slurm_env(2, 0, SLURM_GPUS_PER_NODE="gpu:h100:2")).nproc_per_node == 2
    # CPU jobs: NPROC_PER_NODE when given, else the launcher's default (one process per GPU, 1 without GPUs).
    assert read_launch_env(slurm_env(2, 0, NPROC_PER_NODE="2")).nproc_per_node == 2
    assert plan_launch(read_launch_env(slurm_env(2, 0)), visible_gpus=0).nproc_per_node == 1


def test_port_is_the_same_on_every_node_and_the_users_port_wins():
    assert read_launch_env(slurm_env(2, 0)).master_port == read_launch_env(slurm_env(2, 1)).master_port
    assert read_launch_env(slurm_env(2, 0, job="1")).master_port != read_launch_env(slurm_env(2, 0)).master_port
    assert read_launch_env(slurm_env(2, 1, MASTER_PORT="29555")).master_port == 29555


def test_agreeing_user_variables_are_accepted():
    env = slurm_env(2, 1, NNODES="2", NODE_RANK="1", MASTER_ADDR="gpu1", SLURM_GPUS_ON_NODE="4", NPROC_PER_NODE="4")
    assert read_launch_env(env).nnodes == 2


@pytest.mark.parametrize("name, value, slurm_side", [
    ("NNODES", "3", "SLURM_STEP_NUM_NODES=2"),
    ("NODE_RANK", "0", "SLURM_NODEID=1"),
    ("MASTER_ADDR", "10.0.0.9", "SLURM_STEP_NODELIST=gpu[1-2]"),
    ("NPROC_PER_NODE", "2", "SLURM_GPUS_ON_NODE=4"),
])
def test_contradicting_user_variable_is_one_line_naming_both_values(name, value, slurm_side):
    with pytest.raises(ConfigError) as err:
        read_launch_env(slurm_env(2, 1, SLURM_GPUS_ON_NODE="4", **{name: value}))
    assert len(err.value.problems) == 1
    line = err.value.problems[0]
    assert f"{name}={value}" in line and slurm_side in line and "\n" not in line


def test_batch_script_without_srun_on_several_nodes_is_refused():
    env = {k: v for k, v in slurm_env(2, 0).items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(ConfigError, match="srun --ntasks-per-node=1"):
        read_launch_env(env)
    one_node = {k: v for k, v in slurm_env(1, 0).items() if not k.startswith("SLURM_STEP")}
    assert read_launch_env(one_node).nnodes == 1  # a one-node batch script may run shardtune directly


def test_salloc_shell_on_the_login_host_is_refused():
    # What `salloc -N2` gives the shell on the login host: the job's variables, but no SLURMD_NODENAME.
    env = {k: v for k, v in slurm_env(2, 0).items() if not k.startswith(("SLURM_STEP", "SLURMD"))}
    with pytest.raises(ConfigError, match="outside the nodes of Slurm job 4242") as err:
        read_launch_env(env)
    assert len(err.value.problems) == 1


def test_several_tasks_per_node_are_refused():
    with pytest.raises(ConfigError, match="2 shardtune tasks on a node"):
        read_launch_env(slurm_env(2, 0, SLURM_STEP_TASKS_PER_NODE="2(x2)"))


def test_node_list_and_count_must_agree():
    with pytest.raises(ConfigError, match="lists 2 hosts"):
        read_launch_env(slurm_env(2, 0, SLURM_STEP_NUM_NODES="3"))


def test_ranks_started_by_torchrun_inside_the_job_ignore_slurm():
    rank = slurm_env(2, 1, RANK="5", LOCAL_RANK="1", WORLD_SIZE="8")
    assert inside_launcher(rank)
    assert read_launch_env(rank).scheduler is None


def test_outside_an_allocation_nothing_changes():
    assert read_launch_env({}).scheduler is None
    assert read_launch_env({"SLURM_CONF": "/etc/slurm/slurm.conf"}).scheduler is None


def sbatch_request(**changes) -> SbatchRequest:
    values = dict(config=Path("/work/cfg.yaml"), overrides=("max_steps=3",), nodes=2, gpus_per_node=4,
                  nproc_per_node=4, workdir=Path("/work/my runs"), python="/opt/venv/bin/python",
                  job_name="sft", partition="gpu", time="04:00:00", account="proj1", output=None)
    values.update(changes)
    return SbatchRequest(**values)


def test_sbatch_script_text():
    text = build_sbatch_script(sbatch_request())
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert directives == ["#SBATCH --job-name=sft", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                          "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=32", "#SBATCH --mem=128G",
                          "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00",
                          "#SBATCH --account=proj1", "#SBATCH --signal=USR1@120", "#SBATCH --requeue",
                          "#SBATCH --open-mode=append", "#SBATCH --output=/work/my runs/shardtune-%x-%j.out"]
    assert "cd '/work/my runs'" in lines
    assert "export NPROC_PER_NODE=4" in lines
    assert ("srun --ntasks-per-node=1 /opt/venv/bin/python -m shardtune train /work/cfg.yaml max_steps=3 "
            "|| code=$?") in lines
    assert lines[-1] == 'exit "$code"'
    assert "2 node(s) x 4 process(es) = 8 rank(s)" in lines[1]
    # Every line that is not a directive or a command explains itself.
    assert sum(line.startswith("# ") for line in lines) >= 5


def test_cpu_sbatch_script_requests_no_gpus():
    text = build_sbatch_script(sbatch_request(gpus_per_node=0, nproc_per_node=2, partition=None, time=None,
                                              account=None, resources=NodeResources(2, 0)))
    assert "--gpus-per-node" not in text and "--partition" not in text
    assert "#SBATCH --cpus-per-task=2" in text and "export NPROC_PER_NODE=2" in text
    assert "#SBATCH --mem=0" in text  # all of the node's memory


def test_sbatch_script_signals_before_the_time_limit_and_requeues():
    """SIGUSR1 the computed seconds before the limit (the comment says why); the ranks' 143 requeues the job."""
    text = build_sbatch_script(sbatch_request(signal_seconds=600, signal_source="--signal-seconds"))
    lines = text.splitlines()
    signal = lines.index("#SBATCH --signal=USR1@600")
    assert "600 s before the time limit (--signal-seconds)" in lines[signal - 2]
    assert f"exit {REQUEUE_EXIT_CODE}" in lines[signal - 1]
    assert f'if [ "$code" -eq {REQUEUE_EXIT_CODE} ]; then' in lines
    assert '    scontrol requeue "$SLURM_JOB_ID"' in lines
    assert "set -euo pipefail" in lines and "code=0" in lines  # srun's code is taken without tripping set -e


def test_stop_warning_fits_the_checkpoint_write():
    """warning_seconds: one checkpoint at 200 MiB/s plus 60 s, whole minutes, at least 2 (launch/preemption.py)."""
    assert stop_warning(None, "--signal-seconds", 100 * 2**30) == (
        600, "time to write a node's checkpoint, estimated 100.00 GiB")
    assert stop_warning(None, "--signal-seconds", 0)[0] == 120  # the size unknown: the minimum
    assert stop_warning(900, "--signal-seconds", 100 * 2**30) == (900, "--signal-seconds")


def fake_slurm_bin(folder: Path, srun_code: int) -> Path:
    """srun that exits ``srun_code`` and scontrol that records its arguments, as executables on a PATH."""
    folder.mkdir()
    (folder / "srun").write_text(f'#!/bin/bash\necho "$@" > "{folder}/srun.args"\nexit {srun_code}\n')
    (folder / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> "{folder}/scontrol.args"\n')
    for name in ("srun", "scontrol"):
        (folder / name).chmod(0o755)
    return folder


def run_script(tmp_path: Path, srun_code: int) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "job.sbatch"
    script.write_text(build_sbatch_script(sbatch_request(workdir=tmp_path)))
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0  # syntax
    bin_dir = fake_slurm_bin(tmp_path / f"bin{srun_code}", srun_code)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30), bin_dir


def test_sbatch_script_requeues_the_job_when_the_ranks_exit_143(tmp_path):
    done, bin_dir = run_script(tmp_path, REQUEUE_EXIT_CODE)
    assert done.returncode == 0, done.stderr
    assert (bin_dir / "srun.args").read_text().startswith("--ntasks-per-node=1 /opt/venv/bin/python -m shardtune")
    assert (bin_dir / "scontrol.args").read_text() == "requeue 4242\n"
    assert "requeueing job 4242" in done.stderr


@pytest.mark.parametrize("srun_code", [0, 1, 2])
def test_sbatch_script_passes_other_codes_on_without_requeue(tmp_path, srun_code):
    done, bin_dir = run_script(tmp_path, srun_code)
    assert done.returncode == srun_code
    assert not (bin_dir / "scontrol.args").exists()


def test_sbatch_job_id():
    assert parse_job_id("123\n") == "123"
    assert parse_job_id("123;cluster\n") == "123"
    with pytest.raises(ConfigError):
        parse_job_id("sbatch: error: Batch job submission failed")


def test_slurm_command_writes_the_script(tmp_path, tiny_model_dir):
    script = tmp_path / "job.sbatch"
    done = run_cli("slurm", "examples/tiny/sft_full.yaml", "--nodes", "2", "--gpus-per-node", "4", "--partition",
                   "gpu", "--script", str(script), f"model_name_or_path={tiny_model_dir}", "max_steps=3")
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text and "#SBATCH --partition=gpu" in text
    # Each node's CPUs and memory are requested: 8 CPUs per process, the estimate's floor for the tiny model.
    assert "#SBATCH --cpus-per-task=32" in text and "#SBATCH --mem=8G" in text
    assert f"examples/tiny/sft_full.yaml model_name_or_path={tiny_model_dir} max_steps=3 || code=$?" in text
    # The tiny model's checkpoint is written in well under a minute: the minimum warning, sized by the estimate.
    assert "#SBATCH --signal=USR1@120" in text and "time to write a node's checkpoint, estimated" in text


def test_slurm_command_validates_the_config_and_the_shape_first(tmp_path):
    script = tmp_path / "job.sbatch"
    done = run_cli("slurm", "examples/tiny/sft_full.yaml", "--nodes", "2", "--gpus-per-node", "0",
                   "--script", str(script), "learning_rate=-1")
    assert done.returncode == 2 and "learning_rate" in done.stderr and not script.exists()
    done = run_cli("slurm", "examples/tiny/sft_full.yaml", "--nodes", "0", "--gpus-per-node", "4",
                   "--nproc-per-node", "2", "--script", str(script))
    assert done.returncode == 2 and not script.exists()
    assert "--nodes must be >= 1 (got 0)" in done.stderr and "--nproc-per-node (2) differs" in done.stderr


def test_dry_run_inside_an_allocation_shows_the_c10d_launch(tiny_model_dir):
    env = slurm_env(2, 1, NPROC_PER_NODE="2")
    done = run_cli("train", "examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}", "--dry-run", **env)
    assert done.returncode == 0, done.stderr
    port = port_for_job("4242")
    assert f"rendezvous: c10d at gpu1:{port}, id slurm-4242" in done.stdout
    assert "node 1 (this node): " in done.stdout and "nodes: 2, processes per node: 2, world size: 4" in done.stdout
