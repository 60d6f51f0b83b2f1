"""Every collective of the FSDP setup gets tensors on the engine's device, checked on a CPU machine.

NCCL takes CUDA tensors only, so a broadcast of weights still on the host fails on GPUs while every gloo test
passes. Here the engine's device is the meta device, apart from the host where weights are read: the guard checks
each collective's tensors against it (without running them), so a host tensor handed to a collective fails.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardtune.engines.base import PrecisionSettings
from shardtune.engines.collective_guard import CollectiveDeviceError, CollectiveGuard
from shardtune.engines.distributed import DistContext
from shardtune.engines.fsdp import FSDPEngine, broadcast_from_rank0
from shardtune.engines.fsdp_config import FsdpSettings
from shardtune.model.adapters import FinetuningSettings
from shardtune.model.source import ModelSource

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
META = torch.device("meta")


def _setup(rank: int, init_file: str, model: str, case: str, results: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    guard = CollectiveGuard(META, execute=False).install()
    outcome = "ok"
    try:
        _run_case(case, rank, model)
    except CollectiveDeviceError as err:
        outcome = f"device error: {err}"
    except Exception:  # noqa: BLE001 - reported to the test
        outcome = "crash: " + traceback.format_exc()
    finally:
        guard.uninstall()
    Path(results, f"rank{rank}").write_text(f"{guard.checked}\n{outcome}")
    dist.destroy_process_group()


def _run_case(case: str, rank: int, model_dir: str) -> None:
    ctx = DistContext(rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=META, backend="gloo")
    source = ModelSource(model_dir, FinetuningSettings(finetuning_type="lora"))
    if case == "host-broadcast":
        # What FSDP setup did before: rank 0's weights broadcast while the model was still on the host.
        broadcast_from_rank0(source.load_full())
        return
    settings = FsdpSettings(cpu_ram_efficient_loading=case == "skeleton-rank0-reads")
    engine = FSDPEngine(settings, PrecisionSettings(), ctx)
    model = source.load_full() if case == "whole-model" else engine.build_model(source)
    engine.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-3),
                   lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))


def _outcomes(case: str, model: Path, tmp_path: Path) -> list[tuple[int, str]]:
    results = tmp_path / "results"
    results.mkdir()
    mp.start_processes(_setup, args=(str(tmp_path / "init"), str(model), case, str(results)), nprocs=2,
                       start_method="spawn")
    found = []
    for rank in range(2):
        checked, outcome = (results / f"rank{rank}").read_text().split("\n", 1)
        found.append((int(checked), outcome))
    return found


@pytest.mark.parametrize("case", ["whole-model", "skeleton-rank0-reads"])
def test_fsdp_setup_collectives_use_the_engine_device(case, tiny_model_dir, tmp_path):
    outcomes = _outcomes(case, tiny_model_dir, tmp_path)
    assert all(outcome == "ok" for _, outcome in outcomes), outcomes
    assert all(checked > 0 for checked, _ in outcomes), "the guard saw no collective: it checked nothing"


def test_guard_catches_a_broadcast_of_host_weights(tiny_model_dir, tmp_path):
    outcomes = _outcomes("host-broadcast", tiny_model_dir, tmp_path)
    for _, outcome in outcomes:
        assert outcome.startswith("device error: collective broadcast got a tensor on cpu"), outcome
        assert "the engine's device is meta" in outcome
