"""Every engine option through `FORCE_TORCHRUN=1 NPROC_PER_NODE=N shardtune train`, against one process.

Each run trains the same seed and data with the same global batch; per-step losses must match the
single-process run, and the final model must reload in plain transformers (or peft) with full weights.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import COMMON, check_saved_model, logged, losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ENGINES = {
    "ddp": (),
    # The unused-parameter search with accumulation (DDP's static graph would fail here: engines/ddp.py).
    "ddp-find_unused": ("ddp_find_unused_parameters=true",),
    "fsdp2-full_shard": ("fsdp=full_shard auto_wrap",),
    "fsdp2-shard_grad_op-forward_prefetch": ("fsdp=shard_grad_op auto_wrap",
                                             "fsdp_config={'fsdp_forward_prefetch': true}"),
    "fsdp2-no_shard": ("fsdp=no_shard",),
    "fsdp2-full_shard-offload": ("fsdp=full_shard auto_wrap offload",),
    "fsdp2-size_wrap-full_state_dict": ("fsdp=full_shard", "fsdp_config={'fsdp_auto_wrap_policy': "
                                        "'SIZE_BASED_WRAP', 'fsdp_min_num_params': 20000, "
                                        "'fsdp_state_dict_type': 'FULL_STATE_DICT'}"),
    "fsdp1-full_shard": ("fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_version': 1}"),
    "fsdp1-shard_grad_op-prefetch": ("fsdp=shard_grad_op auto_wrap", "fsdp_config={'fsdp_version': 1, "
                                     "'fsdp_backward_prefetch': 'BACKWARD_POST', 'fsdp_forward_prefetch': true}"),
    "fsdp1-no_shard": ("fsdp=no_shard", "fsdp_config={'fsdp_version': 1}"),
    "deepspeed-z0": ("deepspeed=z0",),
    "deepspeed-z1": ("deepspeed=z1",),
    "deepspeed-z2": ("deepspeed=z2",),
    "deepspeed-z2_offload": ("deepspeed=z2_offload",),
    "deepspeed-z3": ("deepspeed=z3",),
    "deepspeed-z3_offload": ("deepspeed=z3_offload",),
    # torch_compile: each decoder layer compiled (aot_eager: traced as inductor's input, fast to build on CPU).
    "ddp-compile": ("torch_compile=true", "torch_compile_backend=aot_eager"),
    "fsdp2-full_shard-compile": ("fsdp=full_shard auto_wrap", "torch_compile=true", "torch_compile_backend=aot_eager"),
    "deepspeed-z2-compile": ("deepspeed=z2", "torch_compile=true", "torch_compile_backend=aot_eager"),
    # Padded rows (as on a GPU under sdpa), which torch_compile leaves without a padding mask (train/setup.py).
    "ddp-compile-padded": ("torch_compile=true", "torch_compile_backend=aot_eager", "padding_free=false"),
}
WITH_LORA = ("ddp", "fsdp2-full_shard", "fsdp1-full_shard", "deepspeed-z2", "deepspeed-z3", "deepspeed-z3_offload",
             "ddp-compile", "fsdp2-full_shard-compile", "deepspeed-z2-compile")
RUNS = [(name, ft) for name in ENGINES for ft in ("full", "lora") if ft == "full" or name in WITH_LORA]


@pytest.mark.parametrize(("engine", "finetuning"), RUNS, ids=[f"{e}-{f}" for e, f in RUNS])
def test_engine_matches_single_process(engine, finetuning, reference, tiny_model_dir, tmp_path):
    results = train(tiny_model_dir, tmp_path, finetuning, 2, 2, *ENGINES[engine])
    assert results["world_size"] == 2
    assert results["engine"] == engine.split("-")[0].rstrip("12")
    assert len(results["peak_memory_bytes_per_rank"]) == 2 and min(results["peak_memory_bytes_per_rank"]) > 0
    assert losses(tmp_path) == pytest.approx(reference[finetuning], rel=2e-3)
    # Losses alone would not see gradients scaled by the world size: Adam's update hardly depends on their scale.
    assert logged(tmp_path, "grad_norm") == pytest.approx(reference[f"{finetuning}:grad_norm"], rel=2e-3)
    check_saved_model(tmp_path, tiny_model_dir, finetuning)
    if "compile" in engine:
        assert results["torch_compile"]["recompiles_after_step_2"] == 0 and results["torch_compile"]["layers"] == 2


HYBRID = {
    "fsdp2-hybrid_shard": ("fsdp=hybrid_shard auto_wrap", "fsdp_config={'hsdp_shard_size': 2}"),
    "fsdp2-hybrid_shard_zero2": ("fsdp=hybrid_shard_zero2 auto_wrap", "fsdp_config={'hsdp_shard_size': 2}"),
    "fsdp1-hybrid_shard_zero2": ("fsdp=hybrid_shard_zero2 auto_wrap",
                                 "fsdp_config={'hsdp_shard_size': 2, 'fsdp_version': 1}"),
}


@pytest.mark.parametrize("engine", list(HYBRID))
def test_hybrid_shard_four_processes_keeps_replicas_equal(engine, reference, tiny_model_dir, tmp_path):
    """HSDP on a 2x2 mesh (replicate x shard): same losses as one process with the same global batch."""
    results = train(tiny_model_dir, tmp_path, "full", 4, 1, *HYBRID[engine])
    assert results["world_size"] == 4
    # Replicas that drifted apart would give a loss different from the single-process run.
    assert losses(tmp_path) == pytest.approx(reference["full"], rel=2e-3)
    check_saved_model(tmp_path, tiny_model_dir, "full")


def test_hybrid_shard_without_enough_processes_is_refused_before_launch(tiny_model_dir, tmp_path):
    result = run_cli("train", *COMMON, f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path}",
                     "fsdp=hybrid_shard", FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 2
    assert "one replica" in result.stderr and "launching" not in result.stdout


BF16_ENGINES = ("ddp", "deepspeed-z2", "deepspeed-z3", "fsdp2-full_shard")
# Measured on the tiny model: losses within 2e-4, gradient norms within 4e-3 of one process (bf16 rounding).
BF16_LOSS_TOLERANCE, BF16_NORM_TOLERANCE = 2e-3, 2e-2


@pytest.fixture(scope="module")
def bf16_reference(tiny_model_dir, tmp_path_factory) -> dict[str, list[float]]:
    out = tmp_path_factory.mktemp("ref-bf16")
    train(tiny_model_dir, out, "full", 1, 4, "bf16=true")
    return {"loss": losses(out), "grad_norm": logged(out, "grad_norm")}


@pytest.mark.parametrize("engine", BF16_ENGINES)
def test_bf16_engine_matches_single_process(engine, bf16_reference, tiny_model_dir, tmp_path):
    """bf16 the way each engine does it (autocast, FSDP mixed-precision policy, DeepSpeed's bf16 section) against
    one process with autocast: bf16 rounding differs between them, a wrong gradient scale (2x) does not hide."""
    train(tiny_model_dir, tmp_path, "full", 2, 2, "bf16=true", *ENGINES[engine])
    assert losses(tmp_path) == pytest.approx(bf16_reference["loss"], rel=BF16_LOSS_TOLERANCE)
    assert logged(tmp_path, "grad_norm") == pytest.approx(bf16_reference["grad_norm"], rel=BF16_NORM_TOLERANCE)
