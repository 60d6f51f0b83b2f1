#!/usr/bin/env python3
"""The rank side of scripts/registry_engines.py: the cells of one launch trained in turn, in one process.

    torchrun --standalone --nproc-per-node 2 scripts/registry_engine_ranks.py CELLS.json STATUS_DIR
    python scripts/registry_engine_ranks.py CELLS.json STATUS_DIR        (the one-process reference)

CELLS.json lists ``{"cell": name, "plan": path}``: each plan is the one the launching host's preflight wrote for
that cell (``shardtune train`` writes the same file before it starts torchrun). A cell runs through shardtune's own
rank entry, ``launch/worker.py``'s ``rank_plan`` and ``run_rank``: build_engine, run_training (tokenizer, data,
model, engine.prepare, loop, save), the rank's failure report. What differs from one ``shardtune train`` per cell is
only that the process, its imports and (under torchrun) its process group serve every cell: the group is joined
here before the first cell, so each cell's engine finds it made and leaves it for the next cell
(``DistContext.owns_group``).

Each rank appends ``start``/``end`` lines to STATUS_DIR/rank-<N>.jsonl; the driver watches them (and each cell's
trainer_log.jsonl) to bound every cell. A failed cell ends a launch of several processes (a peer may be waiting in a
collective that will never complete): the driver starts the remaining cells in a new launch. The one-process
reference has no peer and goes on to its next cell.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# The group's timeout: a collective that waits longer than the driver's bound has failed anyway.
GROUP_TIMEOUT_S = 600


def status_line(status_dir: Path, rank: int, **fields: object) -> None:
    with (status_dir / f"rank-{rank}.jsonl").open("a") as stream:
        stream.write(json.dumps({**fields, "time": time.time(), "pid": os.getpid()}) + "\n")


def main(cells_file: str, status_dir: str) -> None:
    from shardtune.launch import env as launch_env
    from shardtune.launch.worker import leave_rank, rank_plan, run_rank

    cells = json.loads(Path(cells_file).read_text())
    rank_env = launch_env.read_rank_env()
    launched = launch_env.inside_launcher()
    if launched:
        from shardtune.engines.distributed import init_distributed

        init_distributed(rank_env, GROUP_TIMEOUT_S)  # this launch's group, shared by every cell's engine
    status = Path(status_dir)
    for cell in cells:
        status_line(status, rank_env.rank, event="start", cell=cell["cell"])
        plan = rank_plan([cell["plan"]], rank_env)
        if launched:  # the error, if any, is in the cell's output_dir/.shardtune/rank-<N>-error.txt
            code, error = run_rank(plan, rank_env, debug=False), None
        else:
            code, error = run_alone(plan)
        status_line(status, rank_env.rank, event="end", cell=cell["cell"], code=code, error=error)
        if code != 0 and launched:
            leave_rank(code)
    if launched:
        import torch.distributed as dist

        dist.barrier()  # the ranks leave together: none closes its sockets while a peer still sends
    leave_rank(0)


def run_alone(plan) -> tuple[int, str | None]:
    """One process: ``shardtune train``'s in-process run (the CLI reports what it raises)."""
    from shardtune.launch.worker import run_worker

    try:
        return run_worker(plan), None
    except Exception as err:
        return 1, f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"


if __name__ == "__main__":
    main(*sys.argv[1:3])
