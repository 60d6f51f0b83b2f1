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


CASES = ("whole-model", "skeleton-rank0-reads", "host-broadcast", "offload-cuda", "offload-nccl")


def _case_worker(rank: int, init_file: str, model: str, results: str) -> None:
    """One rank of a 2-process gloo group that runs every case in turn (one start-up for all of them), each case's
    collectives checked by its own guard; ``results/<case>.rank<rank>`` holds what the guard checked and the
    outcome. The NCCL-only case comes last: its guard refuses a collective before it runs, on both ranks alike."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for case in CASES:
            if case.startswith("offload-"):
                backend = process_group_backend("cuda") if case == "offload-cuda" else "nccl"  # GPU ranks' group
                Path(results, case).mkdir(exist_ok=True)
                checked, outcome = _offload_step(rank, model, backend, Path(results, case))
            else:
                checked, outcome = _setup(rank, model, case)
            Path(results, f"{case}.rank{rank}").write_text(f"{checked}\n{outcome}")
    finally:
        dist.destroy_process_group()


def _setup(rank: int, model: str, case: str) -> tuple[int, str]:
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
    return guard.checked, outcome


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


@pytest.fixture(scope="module")
def outcomes(tiny_model_dir, tmp_path_factory) -> Path:
    """The folder of every case's outcome, from one spawn of the two ranks."""
    folder = tmp_path_factory.mktemp("collective-devices")
    results = folder / "results"
    results.mkdir()
    mp.start_processes(_case_worker, args=(str(folder / "init"), str(tiny_model_dir), str(results)), nprocs=2,
                       start_method="spawn")
    return results


def _outcomes(case: str, results: Path) -> list[tuple[int, str]]:
    found = []
    for rank in range(2):
        checked, outcome = (results / f"{case}.rank{rank}").read_text().split("\n", 1)
        found.append((int(checked), outcome))
    return found


@pytest.mark.parametrize("case", ["whole-model", "skeleton-rank0-reads"])
def test_fsdp_setup_collectives_use_the_engine_device(case, outcomes):
    found = _outcomes(case, outcomes)
    assert all(outcome == "ok" for _, outcome in found), found
    assert all(checked > 0 for checked, _ in found), "the guard saw no collective: it checked nothing"


def test_guard_catches_a_broadcast_of_host_weights(outcomes):
    for _, outcome in _outcomes("host-broadcast", outcomes):
        assert outcome.startswith("device error: collective broadcast got a tensor on cpu"), outcome
        assert "the engine's device is meta" in outcome


# ---- the process group's backends: FSDP2 with its shards offloaded to the host ----

def _offload_step(rank: int, model_dir: str, group_backend: str, save_to: Path) -> tuple[int, str]:
    """A real FSDP2 step with offload_params over gloo, then the work done on the offloaded (host) shards, checked
    against the backends of the group GPU ranks would build from ``group_backend``: clipping the gradient norm,
    the full state dict for the final save, and a FULL_STATE_DICT checkpoint."""
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
        engine.save_state(save_to)
        outcome += f" norm={norm:.6f} tensors={len(state)}"
    except CollectiveDeviceError as err:
        outcome = f"device error: {err}"
    finally:
        guard.uninstall()
    dist.barrier()
    return guard.checked, outcome


def test_fsdp2_offload_runs_its_host_collectives_on_the_gpu_ranks_group(outcomes):
    """The group init_distributed builds on GPUs has a backend for host tensors: the offloaded step, its clipping
    and the full-state gathers pass the guard and run (over gloo here)."""
    found = _outcomes("offload-cuda", outcomes)
    assert all(outcome.startswith("ok norm=") for _, outcome in found), found
    norms = [outcome.split()[1] for _, outcome in found]
    assert norms[0] == norms[1], f"the ranks clipped with different norms: {norms}"
    assert not found[0][1].endswith("tensors=0"), "rank 0 gathered no full state"
    assert all(checked > 0 for checked, _ in found), "the guard saw no collective: it checked nothing"
    assert (outcomes / "offload-cuda" / FULL_STATE_FILE).is_file()


def test_an_nccl_only_group_refuses_the_offloaded_clipping(outcomes):
    """What GPU ranks had before (an NCCL-only group, torch issue 148532): the first host collective fails."""
    for _, outcome in _outcomes("offload-nccl", outcomes):
        assert outcome.startswith("device error: collective "), outcome
        assert "no backend type associated with device type cpu in the process group (cuda:nccl)" in outcome
