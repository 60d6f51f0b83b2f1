"""`shardtune estimate CONFIG [key=value ...] [--gpus-per-node N] [--nodes M] [--gpu-memory 80GiB] ...`"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass

from shardtune.errors import ConfigError
from shardtune.estimate.hardware import Hardware, parse_size
from shardtune.host import local_cpu_memory, local_gpu_memory, visible_gpu_count

USAGE = """usage: shardtune estimate CONFIG.yaml [key=value ...] [--gpus-per-node N] [--nodes M]
                          [--gpu-memory SIZE] [--cpu-memory SIZE] [--model-config PATH] [--json]

Estimates per-device memory of every engine option (DDP, ZeRO-1/2/3 with and without offload, FSDP
strategies) from the model's config.json alone, marks which fit and recommends the fastest that does.

  --gpus-per-node N    ranks per node (default: NPROC_PER_NODE, else the GPUs visible here, else 1)
  --nodes M            number of nodes (default: NNODES, else 1)
  --gpu-memory SIZE    memory of one GPU, e.g. 80GiB, 24GB (default: the GPUs visible here)
  --cpu-memory SIZE    CPU memory of one node, e.g. 512GiB (default: this machine's)
  --model-config PATH  config.json (or its folder) when model_name_or_path is a hub id not downloaded here
  --json               print JSON (one object per option, bytes per component) instead of the table"""

VALUE_FLAGS = ("--gpus-per-node", "--nodes", "--gpu-memory", "--cpu-memory", "--model-config")


@dataclass(frozen=True)
class EstimateArgs:
    """The estimate's own flags, and the rest of the command line (config file and overrides)."""

    config_argv: list[str]
    values: dict[str, str]
    as_json: bool


def split_estimate_args(argv: list[str]) -> EstimateArgs:
    """Take our flags (``--flag value`` or ``--flag=value``) out; the rest is a train/check command line."""
    rest: list[str] = []
    values: dict[str, str] = {}
    as_json = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, sep, value = arg.partition("=")
        if arg == "--json":
            as_json = True
        elif name in VALUE_FLAGS:
            if not sep:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"{name} needs a value, e.g. {name} {_EXAMPLES[name]}")
                i += 1
                value = argv[i]
            values[name] = value
        else:
            _refuse_misspelt_flag(name)
            rest.append(arg)
        i += 1
    return EstimateArgs(rest, values, as_json)


def _refuse_misspelt_flag(name: str) -> None:
    """A --flag close to one of ours and no config key: a typo of ours, which the config would call an unknown key
    (and suggest a config key for)."""
    from shardtune.config.schema import key_names

    if not name.startswith("--") or name[2:].replace("-", "_") in key_names():
        return
    close = difflib.get_close_matches(name, [*VALUE_FLAGS, "--json"], n=1, cutoff=0.8)
    if close:
        raise ConfigError(f"estimate: unknown option {name} (did you mean '{close[0]}'?)")


_EXAMPLES = {"--gpus-per-node": "8", "--nodes": "2", "--gpu-memory": "80GiB", "--cpu-memory": "512GiB",
             "--model-config": "path/to/config.json"}


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
    from shardtune.estimate.options import build_options
    from shardtune.estimate.recommend import checkpointing_note, recommend
    from shardtune.estimate.report import Estimate, estimate_dict, render_table

    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    args = split_estimate_args(argv)
    config, _ = load_config(args.config_argv)
    config, _ = with_deepspeed_sequence_parallel(config)  # its problems are `shardtune check`'s to report
    shape = model_shape_for(config, args.values.get("--model-config"))
    hardware = resolve_hardware(args.values, launch_nodes, launch_procs)
    workload = workload_from_config(config)
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
