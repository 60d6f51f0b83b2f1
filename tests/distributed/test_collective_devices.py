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
from shardtune.engines.distributed import DistContext, group_backends, process_group_backend
from shardtune.engines.engine_plan import FsdpSettings
from shardtune.engines.fsdp import FSDPEngine, broadcast_from_rank0
from shardtune.engines.fsdp_config import FULL_STATE_FILE
from shardtune.model.finetuning.settings import FinetuningSettings
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


# ---- the process group's backends: FSDP2 with its shards offloaded to the host ----

def _offload_step(rank: int, init_file: str, model_dir: str, group_backend: str, results: str) -> None:
    """A real FSDP2 step with offload_params over gloo, then the work done on the offloaded (host) shards, checked
    against the backends of the group GPU ranks would build from ``group_backend``: clipping the gradient norm,
    the full state dict for the final save, and a FULL_STATE_DICT checkpoint."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    ctx = DistContext(rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=cpu, backend="gloo")
    engine = FSDPEngine(FsdpSettings(offload_params=True, state_dict_type="FULL_STATE_DICT"), PrecisionSettings(),
                        ctx)
    source = ModelSource(model_dir, FinetuningSettings(finetuning_type="full"))
    engine.prepare(engine.build_model(source), lambda params: torch.optim.AdamW(params, lr=1e-3),
                   lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    assert engine.storage_device == cpu
    ids = torch.arange(2, 18).reshape(2, 8) + rank
    engine.backward(engine.model(input_ids=ids, labels=ids).loss)
    # Each shard's gradient is where the shards are kept: on the host (on a GPU too, under offload).
    grads = [p.grad.to_local() for p in engine.iter_trainable() if p.grad is not None]
    assert grads and all(g.device == cpu for g in grads)
    guard = CollectiveGuard(cpu, backends=group_backends(group_backend)).install()
    outcome = "ok"
    try:
        norm = engine.step(max_grad_norm=1.0)
        state = engine.full_state_dict()
        engine.save_state(Path(results))
        outcome += f" norm={norm:.6f} tensors={len(state)}"
    except CollectiveDeviceError as err:
        outcome = f"device error: {err}"
    finally:
        guard.uninstall()
    Path(results, f"rank{rank}").write_text(f"{guard.checked}\n{outcome}")
    dist.barrier()
    dist.destroy_process_group()


def _offload_outcomes(group_backend: str, model: Path, tmp_path: Path) -> list[tuple[int, str]]:
    results = tmp_path / "results"
    results.mkdir()
    mp.start_processes(_offload_step, args=(str(tmp_path / "init"), str(model), group_backend, str(results)),
                       nprocs=2, start_method="spawn")
    return [(int(c), o) for c, o in ((results / f"rank{r}").read_text().split("\n", 1) for r in range(2))]


def test_fsdp2_offload_runs_its_host_collectives_on_the_gpu_ranks_group(tiny_model_dir, tmp_path):
    """The group init_distributed builds on GPUs has a backend for host tensors: the offloaded step, its clipping
    and the full-state gathers pass the guard and run (over gloo here)."""
    outcomes = _offload_outcomes(process_group_backend("cuda"), tiny_model_dir, tmp_path)
    assert all(outcome.startswith("ok norm=") for _, outcome in outcomes), outcomes
    norms = [outcome.split()[1] for _, outcome in outcomes]
    assert norms[0] == norms[1], f"the ranks clipped with different norms: {norms}"
    assert not outcomes[0][1].endswith("tensors=0"), "rank 0 gathered no full state"
    assert all(checked > 0 for checked, _ in outcomes), "the guard saw no collective: it checked nothing"
    assert (tmp_path / "results" / FULL_STATE_FILE).is_file()


def test_an_nccl_only_group_refuses_the_offloaded_clipping(tiny_model_dir, tmp_path):
    """What GPU ranks had before (an NCCL-only group, torch issue 148532): the first host collective fails."""
    outcomes = _offload_outcomes("nccl", tiny_model_dir, tmp_path)
    for _, outcome in outcomes:
        assert outcome.startswith("device error: collective "), outcome
        assert "no backend type associated with device type cpu in the process group (cuda:nccl)" in outcome
