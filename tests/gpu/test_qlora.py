"""QLoRA on the GPU through the real CLI: 4-bit bitsandbytes base + LoRA, alone and sharded by FSDP2 and FSDP1.

The sharded runs (as many processes as GPUs) must match the single-process QLoRA run step for step within bf16
tolerance - packed 4-bit weights corrupted by a float copy, or a lost quantisation state, would not - and save an
adapter that loads onto the unquantised base model.
"""

from __future__ import annotations

import pytest

from tests.gpu.helpers import BF16_RTOL, GPUS, MICRO, check_adapter_saved, check_memory_records, needs_gpu, train

pytestmark = [*needs_gpu(), pytest.mark.timeout(900)]

QLORA = ("quantization_bit=4",)
FSDP = {
    "fsdp2": ("fsdp=full_shard auto_wrap",),
    "fsdp1": ("fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_version': 1}"),
}


@pytest.fixture(scope="module")
def qlora_single(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    return train(tiny_model_dir, tmp_path_factory.mktemp("qlora-single"), "lora", *QLORA, micro=MICRO * GPUS)


def test_qlora_one_process_trains_and_saves_an_adapter(qlora_single, tiny_model_dir):
    assert qlora_single.results["engine"] == "local"
    assert qlora_single.losses[-1] < qlora_single.losses[0], qlora_single.losses
    check_memory_records(qlora_single.results, 1)
    check_adapter_saved(qlora_single.out, tiny_model_dir)


@pytest.mark.parametrize("version", list(FSDP))
def test_fsdp_qlora_matches_one_process(version, qlora_single, tiny_model_dir, tmp_path):
    if version == "fsdp1" and GPUS > 1:
        pytest.skip("FSDP1 QLoRA on several processes is refused before launch (tests/unit/test_engine_plan.py)")
    run = train(tiny_model_dir, tmp_path, "lora", *QLORA, *FSDP[version], processes=GPUS)
    assert run.results["engine"] == "fsdp" and run.results["world_size"] == GPUS
    check_memory_records(run.results, GPUS)
    assert run.losses == pytest.approx(qlora_single.losses, rel=BF16_RTOL)
    check_adapter_saved(tmp_path, tiny_model_dir)
