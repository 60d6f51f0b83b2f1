"""pure_bf16: weights, gradients and optimizer state in bfloat16 without autocast (LLaMA-Factory's meaning) on one
process; refused before launch where an engine keeps fp32 master weights."""

from __future__ import annotations

import pytest

from shardtune.config.load import build_config
from shardtune.engines.plan import plan_engine
from tests.distributed.helpers import losses, train

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_pure_bf16_trains_bf16_weights_with_less_memory(wider_model_dir, tmp_path):
    """On the wider model, so that the state's share decides the peak: fp32 weights, gradients and AdamW moments are
    16 bytes per parameter, pure bf16 8; the tiny model's saving (~3 MB) was below the process's memory noise."""
    # Two steps: the optimizer's state exists from the first, and the peak with it.
    mixed = train(wider_model_dir, tmp_path / "mixed", "full", 1, 2, "bf16=true", "max_steps=2")
    pure = train(wider_model_dir, tmp_path / "pure", "full", 1, 2, "pure_bf16=true", "max_steps=2")
    assert mixed["trainable_parameter_dtypes"] == ["float32"]
    assert pure["trainable_parameter_dtypes"] == ["bfloat16"]
    parameters = (wider_model_dir / "model.safetensors").stat().st_size // 4  # saved in fp32
    saving = mixed["peak_memory_bytes_per_rank"][0] - pure["peak_memory_bytes_per_rank"][0]
    assert saving > 4 * parameters, (saving, parameters)  # half of the 8 bytes per parameter, for allocator noise
    assert losses(tmp_path / "pure") == pytest.approx(losses(tmp_path / "mixed"), rel=5e-2)


@pytest.mark.parametrize("engine", [{"deepspeed": "z2"}, {"fsdp": "full_shard auto_wrap"}], ids=["zero2", "fsdp"])
def test_pure_bf16_is_refused_where_fp32_master_weights_stay(engine):
    config = build_config({"model_name_or_path": "m", "output_dir": "o", "dataset": "d", "pure_bf16": True, **engine})
    _, problems = plan_engine(config, 2, has_cuda=False)
    assert any(p.startswith("pure_bf16 (true) with") for p in problems)
