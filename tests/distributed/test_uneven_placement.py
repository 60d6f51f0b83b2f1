"""Ranks placed unevenly over nodes (Ray on partly busy nodes) decide the same thing, so none waits for another.

Four gloo processes stand for three nodes: one of 2 ranks, two of 1 (LOCAL_WORLD_SIZE 2, 2, 1, 1). Hybrid sharding
groups ranks by node. Deciding from its own LOCAL_WORLD_SIZE, a rank of the 2-rank node would build a (2, 2) mesh
and wait in its collectives, while the others refuse: the run hung until the timeout. The ranks gather every
LOCAL_WORLD_SIZE first, and all refuse with the same line.
"""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardtune.engines.distributed import DistContext
from shardtune.engines.engine_plan import FsdpSettings
from shardtune.engines.fsdp import build_mesh
from shardtune.errors import ConfigError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
LOCAL_WORLD_SIZES = (2, 2, 1, 1)


def _rank(rank: int, init_file: str, results: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    world = len(LOCAL_WORLD_SIZES)
    # A short timeout: a rank left waiting fails the test in seconds instead of hanging it.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    ctx = DistContext(rank=rank, local_rank=0, world_size=world, local_world_size=LOCAL_WORLD_SIZES[rank],
                      device=torch.device("cpu"), backend="gloo")
    try:
        mesh = build_mesh(FsdpSettings(sharding_strategy="HYBRID_SHARD"), ctx)
        dist.barrier()
        outcome = f"mesh {tuple(mesh.shape)}"
    except ConfigError as err:
        outcome = f"refused: {err}"
    except Exception:  # noqa: BLE001 - reported to the test
        outcome = "crash: " + traceback.format_exc()
    Path(results, f"rank{rank}").write_text(outcome)
    # Leave together: a rank exiting while a peer's gloo ring is still sending the gather's last pieces to it made
    # that peer abort (SIGABRT) about one run in six.
    dist.barrier()
    dist.destroy_process_group()


def test_uneven_ranks_all_refuse_node_shaped_groups(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    mp.start_processes(_rank, args=(str(tmp_path / "init"), str(results)), nprocs=len(LOCAL_WORLD_SIZES),
                       start_method="spawn")
    outcomes = [(results / f"rank{r}").read_text() for r in range(len(LOCAL_WORLD_SIZES))]
    assert len(set(outcomes)) == 1, outcomes
    assert outcomes[0].startswith("refused: fsdp: HYBRID_SHARD shards within a node, but this job's 4 ranks are "
                                  "spread unevenly over its nodes"), outcomes[0]
