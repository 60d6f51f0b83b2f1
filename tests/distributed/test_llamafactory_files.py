"""LLaMA-Factory files run unchanged: its YAML layout and keys, its dataset_info.json folder, its DeepSpeed JSON.

The files in tests/fixtures/llamafactory/ are written the way LLaMA-Factory's examples are (our own content):
model, method, dataset, output, train and eval sections, LLaMA-Factory key spellings, a data folder with alpaca,
sharegpt with tools, OpenAI-style messages, a ranking entry and an unused hub entry. Each trains on 2 CPU
processes through `shardtune train` with only model_name_or_path, dataset_dir and output_dir given by the test,
under the engine its file names: DDP (FORCE_TORCHRUN), ZeRO-3 (`deepspeed: ds_z3_config.json`) and FSDP2.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.conftest import REPO, run_cli

FIXTURES = REPO / "tests" / "fixtures" / "llamafactory"
# file -> (engine, finetuning type)
FILES = {
    "qwen3_lora_sft.yaml": ("ddp", "lora"),
    "llama3_full_sft_ds3.yaml": ("deepspeed", "full"),
    "qwen3_lora_sft_fsdp.yaml": ("fsdp", "lora"),
    "qwen3_lora_sft_extras.yaml": ("ddp", "lora"),  # adapter variants, vocabulary, trainer extras, tools
    "llama3_lora_stream_pissa.yaml": ("ddp", "lora"),  # streaming, PiSSA, model-only checkpoints
}

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.mark.parametrize("name", list(FILES))
def test_every_key_is_honoured_or_mapped(name):
    result = run_cli("convert-config", str(FIXTURES / name), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 refused, 0 unknown" in result.stdout


@pytest.mark.parametrize("name", list(FILES))
def test_llamafactory_file_trains_unchanged_on_two_processes(name, tiny_model_dir, tmp_path):
    engine, finetuning = FILES[name]
    work = tmp_path / "work"
    shutil.copytree(FIXTURES, work)  # LLaMA-Factory resolves relative paths (the DeepSpeed JSON) from the cwd
    out = tmp_path / "out"
    result = run_cli("train", name, f"model_name_or_path={tiny_model_dir}", "dataset_dir=data",
                     f"output_dir={out}", cwd=work, FORCE_TORCHRUN="1", NPROC_PER_NODE="2", timeout=800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = json.loads((out / "train_results.json").read_text())
    assert results["engine"] == engine and results["world_size"] == 2
    assert results["global_step"] >= 1 and math.isfinite(results["final_loss"])
    saved = "adapter_model.safetensors" if finetuning == "lora" else "model.safetensors"
    assert (out / saved).is_file() or any(out.glob("model-*.safetensors")), sorted(p.name for p in out.iterdir())
    if name == "qwen3_lora_sft.yaml":
        assert results["run_name"] == "qwen3-lora-sft"
        assert "eval_loss" in results  # eval_dataset: messages_demo
        logged = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if line]
        assert [r["current_steps"] for r in logged if "loss" in r][:2] == [1, 2]  # logging_first_step, logging_steps: 2
    if name == "qwen3_lora_sft_extras.yaml":
        assert results["num_input_tokens_seen"] > 0 and "eval_loss" in results  # tokens seen, val_size
    if name == "llama3_lora_stream_pissa.yaml":
        assert (out / "pissa_converted" / "adapter_model.safetensors").is_file()  # pissa_convert
        assert (out / "checkpoint-3" / "MODEL_ONLY").is_file()  # save_only_model: no optimizer state
        assert not any((out / "checkpoint-3").glob("*optim*"))
