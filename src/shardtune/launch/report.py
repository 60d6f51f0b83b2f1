"""The `--dry-run` report: commands for every node, world size, batch arithmetic, resolved engine settings."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardtune.launch.run import Preflight
    from shardtune.launch.torchrun import LaunchPlan


def dry_run_report(pre: Preflight, plan: LaunchPlan, commands: list[list[str]]) -> str:
    from shardtune.launch.run import global_batch

    c = pre.config
    lines = ["shardtune dry run (nothing was started)"]
    if commands:
        for node, argv in enumerate(commands):
            here = " (this node)" if node == plan.node_rank else ""
            lines.append(f"node {node}{here}: {shlex.join(argv)}")
    else:
        lines.append("command: runs in this process (one process, no launcher)")
    if commands and plan.c10d_rendezvous:
        lines.append(f"rendezvous: c10d at {plan.master_addr}:{plan.master_port}, id {plan.rdzv_id} (set by the "
                     "scheduler; every node runs the same command and torchrun numbers the nodes)")
    lines += [
        f"nodes: {plan.nnodes}, processes per node: {plan.nproc_per_node}, world size: {plan.world_size}",
        f"global batch: {c.per_device_train_batch_size} (per_device_train_batch_size) x "
        f"{c.gradient_accumulation_steps} (gradient_accumulation_steps) x {plan.world_size} (data-parallel size) "
        f"= {global_batch(c, plan.world_size)}",
        f"engine: {engine_description(pre, plan)}",
    ]
    settings = resolved_engine_settings(pre, plan)
    if settings is not None:
        lines.append("engine settings:")
        lines.append(json.dumps(settings, indent=2, sort_keys=True))
    return "\n".join(lines)


def engine_description(pre: Preflight, plan: LaunchPlan) -> str:
    kind = pre.engine.kind
    if kind == "local":
        return "local (single process)"
    if kind == "fsdp" and pre.engine.fsdp is not None:
        return f"fsdp{pre.engine.fsdp.version} {pre.engine.fsdp.sharding_strategy}"
    if kind == "deepspeed":
        return f"deepspeed ({pre.engine.deepspeed_source})"
    return kind


def resolved_engine_settings(pre: Preflight, plan: LaunchPlan) -> dict | None:
    if pre.engine.kind == "fsdp" and pre.engine.fsdp is not None:
        return pre.engine.fsdp.to_dict()
    if pre.engine.kind == "deepspeed" and pre.engine.deepspeed_raw is not None:
        from shardtune.engines.deepspeed_config import resolve_deepspeed_config
        from shardtune.launch.run import deepspeed_inputs

        return resolve_deepspeed_config(pre.engine.deepspeed_raw, deepspeed_inputs(pre.config, plan.world_size))
    return None
