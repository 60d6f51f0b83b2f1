"""The `--dry-run` report: commands for every node, world size, batch arithmetic, resolved engine settings."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

from shardtune.engines.expert_parallel_plan import describe_expert_parallel
from shardtune.engines.plan import spec_for
from shardtune.engines.sequence_parallel_plan import describe_sequence_parallel
from shardtune.run_files import LAUNCH_PLAN

if TYPE_CHECKING:
    from shardtune.launch.preflight import RunPlan


def dry_run_report(run: RunPlan, commands: list[list[str]], ray: str | None = None) -> str:
    """``ray``: the Ray plan's description under USE_RAY=1 (then there are no torchrun commands)."""
    plan, layout = run.launch, run.layout
    assert plan is not None
    lines = ["shardtune dry run (nothing was started)"]
    if ray is not None:
        lines.append(f"command: {ray}; each worker runs shardtune's rank entry on {run.run_dir / LAUNCH_PLAN}")
    elif commands:
        for node, argv in enumerate(commands):
            here = " (this node)" if node == plan.node_rank else ""
            lines.append(f"node {node}{here}: {shlex.join(argv)}")
    else:
        lines.append("command: runs in this process (one process, no launcher)")
    if commands and plan.c10d_rendezvous:
        lines.append(f"rendezvous: c10d at {plan.master_addr}:{plan.master_port}, id {plan.rdzv_id} (set by the "
                     "scheduler; every node runs the same command and torchrun numbers the nodes)")
    split = describe_sequence_parallel(run.config, layout)
    experts = describe_expert_parallel(run.config, layout)
    lines += [
        f"nodes: {layout.nodes}, processes per node: {layout.procs_per_node}, world size: {layout.world_size}",
        *([split] if split else []),
        *([experts] if experts else []),
        f"global batch: {layout.describe_global_batch()}",
        f"engine: {engine_description(run)}",
    ]
    settings = resolved_engine_settings(run)
    if settings is not None:
        lines.append("engine settings:")
        lines.append(json.dumps(settings, indent=2, sort_keys=True))
    return "\n".join(lines)


def engine_description(run: RunPlan) -> str:
    return spec_for(run.engine.kind).describe(run.engine)


def resolved_engine_settings(run: RunPlan) -> dict | None:
    return spec_for(run.engine.kind).resolved_settings(run.engine, run.config, run.layout)
