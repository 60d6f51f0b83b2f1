"""add_special_tokens + resize_vocab through the real CLI: one process, then FSDP2 and ZeRO-3 on 2 processes, whose
skeletons are filled from files with fewer embedding rows than the model. Every run must give the one-process
losses (the new rows are the same on every path), save a tokenizer that knows the tokens and an adapter with the
grown embedding and output layer, and export to a model that reloads with the bigger vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TOKENS = ("add_special_tokens=<tool_call>,</tool_call>", "resize_vocab=true")


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vocab-1p")
    train(tiny_model_dir, out, "lora", 1, 4, *TOKENS)
    return out


def check_grown_run(out: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("x <tool_call> y", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids and len(tokenizer) == 2050
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys() if ".lora_" not in k}
    assert shapes == {"base_model.model.model.embed_tokens.weight": [2112, 64],
                      "base_model.model.lm_head.weight": [2112, 64]}
    exported = tmp_path / "exported"
    result = run_cli("export", str(out), "--out", str(exported), "--merge-lora")
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.get_input_embeddings().weight.shape[0] == 2112 == model.config.vocab_size
    assert len(AutoTokenizer.from_pretrained(exported)) == 2050


def test_one_process_grows_the_vocabulary(one_process, tmp_path):
    check_grown_run(one_process, tmp_path)


@pytest.mark.parametrize("engine", [("fsdp=full_shard auto_wrap",), ("deepspeed=z3",)], ids=["fsdp2", "zero3"])
def test_sharded_engines_fill_the_grown_rows_like_one_process(engine, one_process, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    results = train(tiny_model_dir, out, "lora", 2, 2, *TOKENS, *engine)
    assert results["world_size"] == 2
    assert losses(out) == pytest.approx(losses(one_process), rel=2e-3)
    check_grown_run(out, tmp_path)
