"""`shardtune slurm`: validate a config, then write (and optionally submit) a complete, commented sbatch script.

The script runs `srun --ntasks-per-node=1 python -m shardtune train CONFIG` on every node of the allocation;
launch/slurm.py then turns the job's variables into a c10d torchrun launch on each node. The script requests the
node's CPUs (``--cpus-per-task``: the one task per node is shardtune and all its ranks) and memory (``--mem``, per
node): without them a job gets the site's default, often one CPU and a little memory (launch/node_resources.py).

Preemption: Slurm sends SIGUSR1 ``--signal-seconds`` before the time limit (by default the time the estimated
checkpoint needs: launch/preemption.py, ``warning_seconds``); the ranks finish their step, save and exit
``REQUEUE_EXIT_CODE``, and the script then requeues the job, which resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

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


@dataclass(frozen=True)
class SbatchRequest:
    """Everything the script says; paths absolute, so it runs from any directory."""

    config: Path
    overrides: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    nproc_per_node: int
    workdir: Path
    python: str
    job_name: str = "shardtune"
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    output: str | None = None
    resources: NodeResources | None = None  # None: the defaults for nproc_per_node (node_resources)
    # Seconds before the time limit at which Slurm asks the ranks to save and stop (SIGUSR1), and where that came from.
    signal_seconds: int = warning_seconds(0)
    signal_source: str = UNSIZED_CHECKPOINT

    @property
    def world_size(self) -> int:
        return WorldLayout(self.nodes, self.nproc_per_node).world_size


def build_sbatch_script(req: SbatchRequest) -> str:
    """The sbatch script text (pure)."""
    shape = f"{req.nodes} node(s) x {req.nproc_per_node} process(es) = {req.world_size} rank(s)"
    lines = [
        "#!/bin/bash",
        f"# Written by `shardtune slurm` for {req.config}: {shape}.",
        "# Submit with `sbatch THIS_FILE`; the config was validated when this file was written.",
        f"#SBATCH --job-name={req.job_name}",
        f"#SBATCH --nodes={req.nodes}",
        "# One task per node: shardtune starts the node's ranks itself (torchrun, c10d rendezvous).",
        "#SBATCH --ntasks-per-node=1",
    ]
    if req.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={req.gpus_per_node}")
    resources = req.resources or node_resources(None, None, req.nproc_per_node, None)
    lines += [f"# CPUs and memory of each node (the one task is all of the node's ranks; memory: "
              f"{resources.memory_source}).",
              f"#SBATCH --cpus-per-task={resources.cpus}", f"#SBATCH --mem={resources.slurm_memory}"]
    optional = {"partition": req.partition, "time": req.time, "account": req.account}
    lines += [f"#SBATCH --{name}={value}" for name, value in optional.items() if value is not None]
    lines += [
        *preemption_directives(req),
        f"#SBATCH --output={req.output or str(req.workdir / 'shardtune-%x-%j.out')}",
        "set -euo pipefail",
        "# Relative paths in the config (dataset_dir, output_dir, the model) are read from here.",
        f"cd {shlex.quote(str(req.workdir))}",
        "# Processes per node (one per GPU); shardtune checks it against the GPUs Slurm gives each node.",
        f"export NPROC_PER_NODE={req.nproc_per_node}",
        *train_and_requeue_lines(req),
    ]
    return "\n".join(lines) + "\n"


def preemption_directives(req: SbatchRequest) -> list[str]:
    """The warning signal before the time limit, and what lets the job go back to the queue."""
    return [
        f"# Slurm sends SIGUSR1 to the ranks {req.signal_seconds} s before the time limit ({req.signal_source}):",
        f"# they finish the step, save a checkpoint and exit {REQUEUE_EXIT_CODE}; the job is then requeued (below).",
        f"#SBATCH --signal=USR1@{req.signal_seconds}",
        "# The job may go back to the queue (below, and when the cluster preempts it); its log is appended to.",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
    ]


def train_and_requeue_lines(req: SbatchRequest) -> list[str]:
    """srun on every node, then a requeue when the ranks stopped on a signal after saving."""
    train = shlex.join([req.python, "-m", "shardtune", "train", str(req.config), *req.overrides])
    return [
        "# A preemption may signal this shell too: with a trap set, bash lets srun finish (the ranks' save) first.",
        "trap 'echo \"shardtune job: signalled; waiting for the ranks to save\" >&2' TERM USR1",
        "# Every node runs the same command. The first host of SLURM_JOB_NODELIST hosts the rendezvous, on a",
        "# port derived from the job id (export MASTER_PORT=... to choose one); torchrun numbers the nodes.",
        "# The Python below is the one that validated this script: every node must see it (shared filesystem).",
        "# A requeued job (SLURM_RESTART_COUNT > 0) resumes from the newest complete checkpoint in output_dir.",
        "code=0",
        f"srun --ntasks-per-node=1 {train} || code=$?",
        f"# {REQUEUE_EXIT_CODE}: the ranks stopped on SIGUSR1/SIGTERM after saving: back to the queue, not a failure.",
        f"if [ \"$code\" -eq {REQUEUE_EXIT_CODE} ]; then",
        "    echo \"shardtune job: checkpoint saved; requeueing job $SLURM_JOB_ID\" >&2",
        "    scontrol requeue \"$SLURM_JOB_ID\"",
        "    exit 0",
        "fi",
        "exit \"$code\"",
    ]


def build_submit_argv(script: Path) -> list[str]:
    return ["sbatch", "--parsable", str(script)]


def parse_job_id(sbatch_output: str) -> str:
    """`sbatch --parsable` prints ``JOBID`` or ``JOBID;CLUSTER``."""
    match = re.search(r"^(\d+)", sbatch_output.strip())
    if match is None:
        raise ConfigError(f"sbatch printed no job id: {sbatch_output.strip()!r}")
    return match.group(1)


def submit(script: Path) -> str:
    """Submit with sbatch; the job id, or one line with sbatch's own complaint."""
    try:
        done = subprocess.run(build_submit_argv(script), capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ConfigError("--submit: sbatch is not on PATH; run this on a Slurm login node, or submit the "
                          f"script there with `sbatch {script}`") from None
    if done.returncode != 0:
        raise ConfigError(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return parse_job_id(done.stdout)


def slurm_command(args: list[str]) -> int:
    """`shardtune slurm CONFIG --nodes N --gpus-per-node G [...] [key=value ...] [--submit]`."""
    from shardtune.config.args import parse_subcommand
    from shardtune.launch.preflight import preflight

    parser = CommandParser(prog="shardtune slurm", description="Validate CONFIG and write an sbatch "
                                     "script that trains it on N nodes; extra key=value pairs go to the config.")
    add_node_shape_arguments(parser, "node")
    add_resource_arguments(parser, "node")
    parser.add_argument("--cpus-per-task", type=int, dest="cpus_per_node", help="the same as --cpus-per-node")
    parser.add_argument("--partition")
    parser.add_argument("--time", help="time limit, e.g. 04:00:00")
    parser.add_argument("--account")
    parser.add_argument("--job-name", default="shardtune")
    parser.add_argument("--output", help="Slurm's log file pattern (default: shardtune-%%x-%%j.out)")
    parser.add_argument("--signal-seconds", type=int, dest="signal_seconds",
                        help="seconds before the time limit at which the ranks are told to save and stop (SIGUSR1; "
                             "default: the estimated checkpoint's write time, at least 120)")
    parser.add_argument("--script", help="file to write (default: <config name>.sbatch here)")
    parser.add_argument("--submit", action="store_true", help="submit it with sbatch and print the job id")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    ns, overrides = parse_subcommand(parser, args)
    req = sbatch_request(ns, overrides)
    plan = preflight([str(req.config), *overrides], req.nodes, req.nproc_per_node)
    option = estimated_option(plan, req.gpus_per_node)
    seconds, source = stop_warning(ns.signal_seconds, "--signal-seconds", estimated_checkpoint_bytes(option))
    req = replace(req, resources=node_resources(ns.cpus_per_node, ns.memory_per_node, req.nproc_per_node,
                                                estimated_node_memory(option)),
                  signal_seconds=seconds, signal_source=source)
    script = Path(ns.script or f"{req.config.stem}.sbatch").resolve()
    problem = output_file_problem(script, "slurm: --script")
    if problem:
        raise ConfigError(problem)
    script.write_text(build_sbatch_script(req))
    print(f"wrote {script} ({req.nodes} node(s) x {req.nproc_per_node} process(es))")
    if ns.submit:
        print(f"submitted batch job {submit(script)}")
    return 0


def sbatch_request(ns: argparse.Namespace, overrides: list[str]) -> SbatchRequest:
    problems = node_shape_problems(ns.nodes, ns.gpus_per_node, ns.nproc_per_node) + \
        resource_problems(ns.cpus_per_node, ns.memory_per_node)
    if ns.signal_seconds is not None and ns.signal_seconds < 1:
        problems.append(f"--signal-seconds must be >= 1 (got {ns.signal_seconds})")
    if problems:
        raise ConfigError(*problems)
    config = Path(ns.config).resolve()
    return SbatchRequest(
        config=config, overrides=tuple(overrides), nodes=ns.nodes, gpus_per_node=ns.gpus_per_node,
        nproc_per_node=processes_per_node(ns.gpus_per_node, ns.nproc_per_node), workdir=Path.cwd(),
        python=sys.executable,
        job_name=ns.job_name, partition=ns.partition, time=ns.time, account=ns.account, output=ns.output)
