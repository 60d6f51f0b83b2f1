"""`shardtune export` turns sharded checkpoints into plain Hugging Face folders with the trained logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.distributed.test_checkpoints import RUN

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 40).unsqueeze(0)).logits


def trained_and_exported(model_dir: Path, tmp_path: Path, *extra: str, merge: bool = False) -> tuple[Path, Path]:
    out = tmp_path / "run"
    result = run_cli("train", *RUN, f"model_name_or_path={model_dir}", f"output_dir={out}",
                     "per_device_train_batch_size=2", *extra, FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stderr[-4000:]
    exported = tmp_path / "exported"
    args = ["export", str(out / "checkpoint-6"), "--out", str(exported)] + (["--merge-lora"] if merge else [])
    result = run_cli(*args)  # one process, whatever wrote the checkpoint
    assert result.returncode == 0, result.stderr[-4000:]
    return out, exported


@pytest.mark.parametrize("engine", [("deepspeed=z3",), ("fsdp=full_shard auto_wrap",)], ids=["zero3", "fsdp-sharded"])
def test_export_full_checkpoint(engine, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out, exported = trained_and_exported(tiny_model_dir, tmp_path, *engine)
    final = AutoModelForCausalLM.from_pretrained(out)  # the model the run saved at the same step
    plain = AutoModelForCausalLM.from_pretrained(exported)
    assert (exported / "tokenizer.json").is_file()
    torch.testing.assert_close(logits(plain), logits(final))
    assert not torch.allclose(logits(plain), logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir)))


def test_export_lora_checkpoint_merged(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, exported = trained_and_exported(tiny_model_dir, tmp_path, "finetuning_type=lora", "deepspeed=z3",
                                         merge=True)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    merged = AutoModelForCausalLM.from_pretrained(exported)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), logits(adapter), rtol=1e-4, atol=1e-5)
