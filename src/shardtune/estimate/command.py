"""`shardtune estimate CONFIG [key=value ...] [--gpus-per-node N] [--nodes M] [--gpu-memory 80GiB] ...`"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from shardtune.arguments import CommandParser
from shardtune.config.args import parse_subcommand
from shardtune.errors import ConfigError
from shardtune.estimate.hardware import Hardware, parse_size
from shardtune.host import local_cpu_memory, local_gpu_memory, visible_gpu_count

DESCRIPTION = ("Estimates per-device memory of every engine option (DDP, ZeRO-1/2/3 with and without offload, FSDP "
               "strategies) from the model's config.json alone, marks which fit and recommends the fastest that does.")
VALUE_FLAGS = ("--gpus-per-node", "--nodes", "--gpu-memory", "--cpu-memory", "--model-config")


@dataclass(frozen=True)
class EstimateArgs:
    """The estimate's own flags, and the rest of the command line (config file and overrides)."""

    config_argv: list[str]
    values: dict[str, str]
    as_json: bool


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="shardtune estimate", description=DESCRIPTION)
    parser.add_argument("config", nargs="?", help="the training config (YAML)")
    parser.add_argument("--gpus-per-node", metavar="N",
                        help="ranks per node (default: NPROC_PER_NODE, else the GPUs visible here, else 1)")
    parser.add_argument("--nodes", metavar="M", help="number of nodes (default: NNODES, else 1)")
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="memory of one GPU, e.g. 80GiB, 24GB (default: the GPUs visible here)")
    parser.add_argument("--cpu-memory", metavar="SIZE", help="CPU memory of one node, e.g. 512GiB (default: this "
                                                             "machine's)")
    parser.add_argument("--model-config", metavar="PATH", help="config.json (or its folder) when model_name_or_path "
                                                               "is a hub id not downloaded here")
    parser.add_argument("--json", action="store_true", help="print JSON (one object per option, bytes per component) "
                                                            "instead of the table")
    return parser


def split_estimate_args(argv: list[str]) -> EstimateArgs:
    """Our flags (``--flag value`` or ``--flag=value``) and the train command line (config file and settings)."""
    ns, settings = parse_subcommand(build_parser(), argv)
    values = {flag: getattr(ns, flag[2:].replace("-", "_")) for flag in VALUE_FLAGS}
    config = [ns.config] if ns.config is not None else []
    return EstimateArgs([*config, *settings], {k: v for k, v in values.items() if v is not None}, ns.json)


def parse_count(text: str, flag: str) -> int:
    """A positive whole number from ``flag``'s value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{flag} ({text}): must be a whole number of at least 1")
    return value


def resolve_hardware(values: dict[str, str], launch_nodes: int = 1, launch_procs: int | None = None) -> Hardware:
    """Flags first, then the launch variables (NNODES, NPROC_PER_NODE: ``launch_*``) and this machine; no GPU here
    and no --gpu-memory is an error."""
    gpus_here = visible_gpu_count()
    nodes = parse_count(values["--nodes"], "--nodes") if "--nodes" in values else launch_nodes
    per_node = parse_count(values["--gpus-per-node"], "--gpus-per-node") if "--gpus-per-node" in values \
        else (launch_procs or max(gpus_here, 1))
    gpu_memory: int | None
    if "--gpu-memory" in values:
        gpu_memory = parse_size(values["--gpu-memory"], "--gpu-memory")
    else:
        gpu_memory = local_gpu_memory()
        if gpu_memory is None:
            raise ConfigError("--gpu-memory: no GPU is visible here; give the memory of one GPU of the machine "
                              "to estimate for, e.g. --gpu-memory 80GiB")
    cpu_memory = parse_size(values["--cpu-memory"], "--cpu-memory") if "--cpu-memory" in values \
        else local_cpu_memory()
    return Hardware(nodes=nodes, gpus_per_node=per_node, gpu_memory=gpu_memory, cpu_memory=cpu_memory)


def estimate_command(argv: list[str], launch_nodes: int = 1, launch_procs: int | None = None) -> int:
    """Print the estimate table (or JSON) for a training config; exit code 0 even when nothing fits."""
    from shardtune.config.args import load_config
    from shardtune.engines.sequence_parallel_plan import with_deepspeed_sequence_parallel
    from shardtune.estimate.config import model_shape_for, workload_from_config
    from shardtune.estimate.expert_parallel import expert_parallel_problems
    from shardtune.estimate.options import build_options
    from shardtune.estimate.recommend import checkpointing_note, recommend
    from shardtune.estimate.report import Estimate, estimate_dict, render_table

    args = split_estimate_args(argv)
    config, _ = load_config(args.config_argv)
    config, _ = with_deepspeed_sequence_parallel(config)  # its problems are `shardtune check`'s to report
    shape = model_shape_for(config, args.values.get("--model-config"))
    hardware = resolve_hardware(args.values, launch_nodes, launch_procs)
    workload = workload_from_config(config)
    problems = expert_parallel_problems(shape, workload, hardware.nodes, hardware.gpus_per_node)
    if problems:
        raise ConfigError("; ".join(problems))
    options = build_options(shape, workload, hardware)
    estimate = Estimate(shape, workload, hardware, options, recommend(options, hardware, workload))
    note = None
    if not workload.gradient_checkpointing:  # what activation checkpointing would make fit, said with the remedy
        rechecked = build_options(shape, dataclasses.replace(workload, gradient_checkpointing=True), hardware)
        note = checkpointing_note(options, rechecked)
    if args.as_json:
        print(json.dumps({**estimate_dict(estimate), "checkpointing_note": note}, indent=2))
    else:
        print(render_table(estimate) + (f"\n{note}" if note else ""))
    return 0
