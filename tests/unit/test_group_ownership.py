"""An engine destroys the process group only when it created it: a group made before the run (Ray Train's, the
registry matrix's driver that trains cell after cell in one group) is its creator's to destroy."""

from __future__ import annotations

import socket

import torch.distributed as dist

from shardtune.engines.base import PrecisionSettings
from shardtune.engines.ddp import DDPEngine
from shardtune.engines.distributed import init_distributed
from shardtune.world import RankEnv


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_engine_leaves_a_group_it_did_not_create(monkeypatch):
    port = free_port()
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                        "GLOO_SOCKET_IFNAME": "lo"}.items():
        monkeypatch.setenv(name, value)
    rank_env = RankEnv(master_addr="127.0.0.1", master_port=port)
    created = init_distributed(rank_env, 60)
    try:
        joined = init_distributed(rank_env, 60)
        assert created.owns_group and not joined.owns_group
        DDPEngine(PrecisionSettings(), joined).close()
        assert dist.is_initialized()  # the next run's engine joins the same group
        DDPEngine(PrecisionSettings(), created).close()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
