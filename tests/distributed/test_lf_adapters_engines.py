"""DoRA, additional_target (peft modules_to_save), LoRA+, PiSSA and OFT under the engines, 2 processes on CPU,
against one process.

The risky parts: a sharding engine builds the model without its weights, so DoRA's magnitude vector (the norm of
each base row) and the full copy of an additional_target module must come from the files; and the saved adapter
must hold both. Combinations that cannot build are refused before launch.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli
from tests.distributed.helpers import COMMON, losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

DORA = ("use_dora=true", "additional_target=embed_tokens", "lora_target=q_proj,v_proj")
TARGET_ONLY = ("additional_target=embed_tokens", "lora_target=q_proj,v_proj")
LORAPLUS = ("loraplus_lr_ratio=16", "lora_target=q_proj,v_proj")  # parameter groups found after sharding
PISSA = ("pissa_init=true", "pissa_convert=true", "lora_target=q_proj,v_proj")  # replicating engines only
# OFT: the rotation blocks are new host tensors beside a skeleton's empty base (their index buffers too); 4 divides
# the tiny model's widths (64, and 172 for down_proj).
OFT = ("finetuning_type=oft", "oft_block_size=4")
RUNS = {
    "ddp-dora": ((), DORA),
    "fsdp2-dora": (("fsdp=full_shard auto_wrap",), DORA),
    "fsdp1-dora": (("fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_version': 1}"), DORA),
    "zero3-additional_target": (("deepspeed=z3",), TARGET_ONLY),
    "fsdp2-loraplus": (("fsdp=full_shard auto_wrap",), LORAPLUS),
    "zero3-loraplus": (("deepspeed=z3",), LORAPLUS),
    "ddp-pissa": ((), PISSA),
    "zero2-pissa": (("deepspeed=z2",), PISSA),
    "ddp-oft": ((), OFT),
    "fsdp2-oft": (("fsdp=full_shard auto_wrap",), OFT),
    "fsdp1-oft": (("fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_version': 1}"), OFT),
    "zero3-oft": (("deepspeed=z3",), OFT),
}


class References(dict):
    """One-process runs of each adapter variant, trained when a cell first asks for one."""

    def __init__(self, model, tmp_path_factory):
        super().__init__()
        self.model, self.tmp_path_factory = model, tmp_path_factory

    def __missing__(self, adapter):
        out = self.tmp_path_factory.mktemp("ref")
        train(self.model, out, "lora", 1, 4, *adapter)
        self[adapter] = out
        return out


@pytest.fixture(scope="module")
def references(tiny_model_dir, tmp_path_factory):
    return References(tiny_model_dir, tmp_path_factory)


def _adapter(out):
    from safetensors.torch import load_file

    return load_file(str(out / "adapter_model.safetensors"))


@pytest.mark.parametrize("run", list(RUNS))
def test_adapter_variant_matches_one_process(run, references, tiny_model_dir, tmp_path):
    engine, adapter = RUNS[run]
    results = train(tiny_model_dir, tmp_path, "lora", 2, 2, *engine, *adapter)
    assert results["world_size"] == 2
    reference = references[adapter]
    assert losses(tmp_path) == pytest.approx(losses(reference), rel=2e-3)
    saved, expected = _adapter(tmp_path), _adapter(reference)
    assert sorted(saved) == sorted(expected)
    if "additional_target=embed_tokens" in adapter:
        assert "base_model.model.model.embed_tokens.weight" in saved
    if "use_dora=true" in adapter:
        assert any(k.endswith("lora_magnitude_vector") for k in saved)
    if adapter == OFT:
        assert len(saved) == 14 and all(k.endswith(".oft_R.weight") for k in saved)
        assert all(value.abs().sum() > 0 for value in saved.values()), "a rotation did not train"
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, rtol=2e-3, atol=2e-4, msg=key)
    if "pissa_convert=true" in adapter:
        converted, expected = _adapter(tmp_path / "pissa_converted"), _adapter(reference / "pissa_converted")
        assert sorted(converted) == sorted(expected)
        for key, value in expected.items():
            torch.testing.assert_close(converted[key], value, rtol=2e-3, atol=2e-4, msg=key)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained_embedding = not torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)
    assert trained_embedding == ("additional_target=embed_tokens" in adapter)


def test_dora_under_zero3_is_refused_before_launch(tiny_model_dir, tmp_path):
    result = run_cli("train", *COMMON, f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path}",
                     "finetuning_type=lora", "use_dora=true", "deepspeed=z3", FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 2
    assert "use_dora (true) with DeepSpeed ZeRO-3" in result.stderr and "launching" not in result.stdout
