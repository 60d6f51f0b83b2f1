"""Sharded from the first byte: a ~200M-parameter model (fp32 weights >= 800 MB) on 2 CPU processes.

A sharding engine must never hold the whole model on a rank, not even while loading. Each rank's peak resident
memory (train_results.json) is compared with the same run on the tiny model, which measures the runtime's own
overhead (interpreter, libraries, allocator): under ZeRO-3 and FSDP2 FULL_SHARD a LoRA run with the shipped LoRA
examples' settings (all linear layers, bf16, cutoff 128, micro-batch 1, gradient checkpointing as LLaMA-Factory
runs them, the final adapter save) stays below 0.65 x the model's bytes above that overhead, while DDP holds the
full copy. Full fine-tuning keeps each rank's setup peak near its share of the model (no transient full copy).
Each engine gets a model shaped so a layer is a small part of it, as in real LLMs (a Llama-3-8B layer is 2.7% of
the model): FSDP2 gathers a whole decoder layer at a time (with its all-gather buffers, about 4 layers' worth on
gloo), so it gets 46 thin layers (2.2% each); ZeRO-3 gathers one module at a time but keeps some bookkeeping per
layer, so it gets 18 wider layers (5.5% each). Both are over 200M parameters and 800 MB.
Several minutes of 2 cores: marked `bigmodel`, run by `make test-big` (see README, Tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import losses

# real_launch: these tests measure each rank's memory, which a fork of the rank server shares with its parent.
pytestmark = [pytest.mark.distributed, pytest.mark.bigmodel, pytest.mark.real_launch, pytest.mark.timeout(1800)]

SHAPES = {"fsdp2": ("--layers", "46", "--hidden", "640", "--heads", "10", "--kv-heads", "2", "--intermediate", "1792"),
          "zero3": ("--layers", "18", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--intermediate", "2816")}
RUN = ("examples/tiny/pt_full.yaml", "max_steps=2", "logging_steps=1", "save_strategy=no", "plot_loss=false",
       "max_samples=16", "cutoff_len=8", "per_device_train_batch_size=1", "gradient_accumulation_steps=1",
       "learning_rate=1e-4", "lr_scheduler_type=constant", "warmup_ratio=0", "lora_target=q_proj")
# ZeRO-3 as shipped keeps up to 1e9 gathered parameters alive (the whole of this model) and prefetches; bound it
# as one would for a model larger than a device.
Z3_BOUNDED = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e6, "stage3_max_reuse_distance": 0,
                                    "stage3_prefetch_bucket_size": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True}}
# examples/tiny/sft_lora.yaml (LoRA rank 16 on all linear layers) with examples/train_lora/llama3_lora_sft.yaml's
# bf16 and micro-batch 1, at cutoff 128, with activation checkpointing (LLaMA-Factory's default); the final save runs.
# A small constant learning rate keeps the engines' bf16 rounding from growing into different losses (memory does not
# depend on it).
LORA_RUN = ("examples/tiny/sft_lora.yaml", "max_steps=3", "logging_steps=1", "save_strategy=no", "plot_loss=false",
            "max_samples=64", "cutoff_len=128", "per_device_train_batch_size=1", "bf16=true",
            "gradient_checkpointing=true", "learning_rate=1e-4", "lr_scheduler_type=constant", "warmup_ratio=0")
MIB = 2**20


@pytest.fixture(scope="module")
def big_models(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """Per engine: the model folder and its weights' bytes."""
    found = {}
    for engine, shape in SHAPES.items():
        out = tmp_path_factory.mktemp("models") / f"big-{engine}"
        result = run_cli("make-tiny-model", "--out", str(out), *shape)
        assert result.returncode == 0, result.stderr[-2000:]
        found[engine] = out, (out / "model.safetensors").stat().st_size
        assert found[engine][1] >= 800e6
    return found


@pytest.fixture(scope="module")
def z3_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ds") / "z3_bounded.json"
    path.write_text(json.dumps(Z3_BOUNDED))
    return str(path)


def run(model: Path, out: Path, finetuning: str, *engine: str) -> dict:
    base = LORA_RUN if finetuning == "lora" else RUN
    result = run_cli("train", *base, f"model_name_or_path={model}", f"output_dir={out}",
                     f"finetuning_type={finetuning}", *engine, FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((out / "train_results.json").read_text())


def engines(z3_file: str) -> dict[str, tuple[str, ...]]:
    return {"fsdp2": ("fsdp=full_shard auto_wrap",), "zero3": (f"deepspeed={z3_file}",), "ddp": ()}


def above_tiny_run(model: Path, tiny: Path, out: Path, finetuning: str, settings: tuple[str, ...],
                   key: str) -> tuple[list[int], list[int]]:
    """Per rank: the big model's measurement ``key`` minus the tiny model's (the runtime's own overhead), and the
    tiny run's values."""
    overhead = run(tiny, out / "tiny", finetuning, *settings)[key]
    big = run(model, out / "big", finetuning, *settings)[key]
    return [b - o for b, o in zip(big, overhead, strict=True)], overhead


def check_zero3_memory_line(results: dict) -> None:
    """Issue 42.10, measured on 2 CPU ranks (docs/estimate.md, "Measured: ZeRO-3 LoRA"): every rank measures from
    the same libraries (rank 0 alone used to count datasets and its dependencies: 830 against 712 MB); the set-up
    peak is within 15% of its estimate now that it counts the adapters' copies (1.33 before, 1.06 after); the whole
    run's peak measured 1.42 times the estimate before it counted the layer a checkpointed backward holds
    gathered, the adapters in fp32 and the CPU's bf16 kernels, and before the ranks bounded those kernels' caches;
    1.135 to 1.192 after that, from run to run, while the launcher let glibc's heap hold the LoRA run's small tensors
    (mmap threshold 128 KiB), and 1.110 to 1.112 since it maps them (64 KiB;
    benchmarks/gather_mmap_threshold_cpu.py)."""
    peaks = results["peak_memory_bytes_per_rank"]
    assert max(peaks) < 1.05 * min(peaks), peaks
    assert 0.85 <= results["setup_memory_measured_over_estimate"] <= 1.15, results
    assert 0.85 <= results["memory_measured_over_estimate"] <= 1.15, results


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_lora_rank_never_holds_the_model(engine, big_models, z3_file, tiny_model_dir, tmp_path):
    model, weights = big_models[engine]
    gained, overhead = above_tiny_run(model, tiny_model_dir, tmp_path, "lora", engines(z3_file)[engine],
                                      "peak_process_memory_bytes_per_rank")
    for rank, extra in enumerate(gained):
        assert extra < 0.65 * weights, (f"rank {rank}: {extra / MIB:.0f} MiB above the tiny run; "
                                        f"model {weights / MIB:.0f} MiB")
    assert (tmp_path / "big" / "adapter_model.safetensors").is_file()  # the peak includes the final save
    if engine == "zero3":
        check_zero3_memory_line(json.loads((tmp_path / "big" / "train_results.json").read_text()))
    # The replicated engine does hold the whole model: the measurement can tell the two apart.
    ddp = run(model, tmp_path / "ddp", "lora")
    assert min(ddp["peak_process_memory_bytes_per_rank"]) - max(overhead) > weights
    # Loaded shard by shard, trained the same: the losses of the whole-model loading path (DDP). Each engine rounds
    # to bf16 its own way (DDP autocasts and keeps norms in fp32, FSDP2 gathers bf16 weights, DeepSpeed casts the
    # module): seen 0.2% (FSDP2) and 0.6% (ZeRO-3) on this random model at the 2048-entry vocabulary's 10-12 nats.
    assert losses(tmp_path / "big") == pytest.approx(losses(tmp_path / "ddp"), rel=1e-2)


def test_rank0_alone_reads_weights_with_cpu_ram_efficient_loading(big_models, tmp_path):
    model, weights = big_models["fsdp2"]
    result = run(model, tmp_path / "out", "lora", "fsdp=full_shard auto_wrap",
                 "fsdp_config={'fsdp_cpu_ram_efficient_loading': true}")
    read = result["weights_bytes_read_per_rank"]
    assert read[1] == 0 and read[0] == pytest.approx(weights, rel=0.01)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_full_finetune_setup_peak_is_the_shard(engine, big_models, z3_file, tiny_model_dir, tmp_path):
    """No transient full copy while loading: the setup peak is this rank's share of the model states."""
    model, weights = big_models[engine]
    gained, _ = above_tiny_run(model, tiny_model_dir, tmp_path, "full", engines(z3_file)[engine],
                               "peak_setup_process_memory_bytes_per_rank")
    # What each engine holds once set up, per rank: FSDP2 its fp32 parameter shards; ZeRO-3 also its fp32 master
    # partition and its gradient partition (3 x 4 bytes a parameter). Both create Adam's states at the first step.
    states = weights / 2 * (1 if engine == "fsdp2" else 3)
    for rank, extra in enumerate(gained):
        assert abs(extra - states) < 0.15 * states, (f"rank {rank}: setup peak {extra / MIB:.0f} MiB above the tiny "
                                                     f"run, model states {states / MIB:.0f} MiB")
