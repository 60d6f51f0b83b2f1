"""Every engine on the GPUs of this machine through the real CLI, bf16 over NCCL, against one plain process.

As many processes as GPUs (one on a one-GPU machine: FORCE_TORCHRUN gives DDP, FSDP and DeepSpeed their process
group). Per-step losses must match the single-process bf16 run within bf16 tolerance, the run must have used NCCL,
record its peak memory per rank and save a model that reloads with trained weights.
"""

from __future__ import annotations

import pytest

from tests.gpu.helpers import (
    BF16_RTOL,
    GPUS,
    check_adapter_saved,
    check_full_model_saved,
    check_memory_records,
    needs_gpu,
    train,
    used_nccl,
)

pytestmark = [*needs_gpu(), pytest.mark.timeout(1200)]

ENGINES = {
    "ddp": ("ddp", ()),
    "fsdp2-full_shard": ("fsdp", ("fsdp=full_shard auto_wrap",)),
    "fsdp1-full_shard": ("fsdp", ("fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_version': 1}")),
    "zero2": ("deepspeed", ("deepspeed=z2",)),
    "zero3": ("deepspeed", ("deepspeed=z3",)),
}
WITH_LORA = ("fsdp2-full_shard", "zero3")
RUNS = [(name, ft) for name in ENGINES for ft in ("full", "lora") if ft == "full" or name in WITH_LORA]


def test_local_engine_runs_on_the_gpu(bf16_reference):
    for finetuning, run in bf16_reference.items():
        assert run.results["engine"] == "local" and run.results["world_size"] == 1, finetuning
        assert run.losses[-1] < run.losses[0], f"{finetuning}: loss did not fall: {run.losses}"
        check_memory_records(run.results, 1)
        # On a GPU the peak is accelerator memory: the tiny model's states and activations, far below 1 GiB.
        assert run.results["peak_memory_bytes_per_rank"][0] < 2**30


@pytest.mark.parametrize(("engine", "finetuning"), RUNS, ids=[f"{e}-{f}" for e, f in RUNS])
def test_engine_matches_single_process_bf16(engine, finetuning, bf16_reference, tiny_model_dir, tmp_path):
    kind, overrides = ENGINES[engine]
    run = train(tiny_model_dir, tmp_path, finetuning, *overrides, processes=GPUS)
    assert run.results["engine"] == kind and run.results["world_size"] == GPUS
    assert used_nccl(run), "no sign of NCCL: the process group did not run on the GPU backend"
    check_memory_records(run.results, GPUS)
    assert run.losses == pytest.approx(bf16_reference[finetuning].losses, rel=BF16_RTOL)
    if finetuning == "lora":
        check_adapter_saved(tmp_path, tiny_model_dir)
    else:
        check_full_model_saved(tmp_path, tiny_model_dir)
