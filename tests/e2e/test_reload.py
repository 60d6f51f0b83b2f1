"""The saved final model (full weights or LoRA adapter) reloads and gives the in-memory model's logits."""

from __future__ import annotations

import pytest
import torch

from shardtune.config.args import load_config
from shardtune.engines.base import PrecisionSettings
from shardtune.engines.local import LocalEngine
from shardtune.train.workflow import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def train_in_process(example: str, model_dir, out, *overrides: str) -> LocalEngine:
    config, _ = load_config([example, f"model_name_or_path={model_dir}", f"output_dir={out}", "max_steps=5",
                             "plot_loss=false", *overrides])
    engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
    run_training(config, engine)
    return engine


def reference_logits(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(3, 40).unsqueeze(0)
    model.eval()
    with torch.no_grad():
        return ids, model(input_ids=ids).logits


def test_full_model_reloads_with_same_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = train_in_process("examples/tiny/sft_full.yaml", tiny_model_dir, tmp_path, "do_eval=false",
                              "eval_strategy=no", "val_size=0")
    ids, expected = reference_logits(engine.unwrapped_model())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    _, got = reference_logits(reloaded)
    torch.testing.assert_close(got, expected)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.allclose(reference_logits(base)[1], expected), "training changed nothing"


def test_lora_adapter_reloads_with_same_logits(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = train_in_process("examples/tiny/sft_lora.yaml", tiny_model_dir, tmp_path)
    ids, expected = reference_logits(engine.unwrapped_model())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reloaded = PeftModel.from_pretrained(base, tmp_path)
    _, got = reference_logits(reloaded)
    torch.testing.assert_close(got, expected)
