"""This year's MoE and hybrid families on the GPU in bf16 (issue 29): grouped expert GEMMs, linear-attention and
state-space layers and DeepSeek-V4's compressed attention under FSDP2 and ZeRO-3, each against the same family's
one-process run (the local engine) on the same GPUs' global batch. Tiny random models from transformers' own config
classes (the registry matrix's builder)."""

from __future__ import annotations

import pytest

from tests.gpu.helpers import BF16_RTOL, GPUS, MICRO, needs_gpu, train

pytestmark = [*needs_gpu(), pytest.mark.timeout(900)]

# Hybrid linear attention + MoE, compressed attention + hash-routed MoE, Mamba-2 hybrid, a plain MoE.
FAMILIES = ("qwen3_next", "qwen3_5_moe_text", "deepseek_v4", "nemotron_h", "qwen3_moe")
ENGINES = {"fsdp2": ("fsdp=full_shard auto_wrap",), "zero3": ("deepspeed=z3",)}


@pytest.fixture(scope="module")
def references(arch_model_dir, tmp_path_factory):
    built = {}

    def reference(family: str):
        if family not in built:
            model = arch_model_dir(f"registry:{family}")
            built[family] = (model, train(model, tmp_path_factory.mktemp(f"ref-{family}"), "full",
                                          micro=MICRO * GPUS))
        return built[family]
    return reference


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_in_bf16_on_the_gpu_as_one_process(family, engine, references, tmp_path):
    model, one = references(family)
    run = train(model, tmp_path, "full", *ENGINES[engine], processes=GPUS)
    assert run.results["world_size"] == GPUS
    assert run.losses == pytest.approx(one.losses, rel=BF16_RTOL)
