"""LLaMA-Factory's inference and merge files, written as its examples/inference/*.yaml and examples/merge_lora/*.yaml
are (tests/fixtures/llamafactory/inference, merge_lora: our own files, tiny local model paths), run unchanged with
`shardtune chat FILE` and `shardtune export FILE` in a folder laid out as LLaMA-Factory's users have it: the base
model in models/, the trained LoRA adapter and full model under saves/ (trained here by LLaMA-Factory's training
file of the same example)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

FIXTURES = REPO / "tests" / "fixtures" / "llamafactory"
TRAIN_FILE = FIXTURES / "qwen3_lora_sft.yaml"
QUICK = ("dataset=alpaca_en_demo", "max_samples=8", "max_steps=2", "eval_dataset=", "eval_strategy=no",
         "eval_steps=null", "plot_loss=false", "bf16=false")


def train_lf_file(root: Path, finetuning: str, out: str) -> None:
    result = run_cli("train", str(TRAIN_FILE), "model_name_or_path=models/Qwen3-4B-Instruct-2507",
                     f"dataset_dir={FIXTURES / 'data'}", f"finetuning_type={finetuning}", f"output_dir={out}", *QUICK,
                     cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def workdir(arch_model_dir, tmp_path_factory) -> Path:
    """models/Qwen3-4B-Instruct-2507 (a tiny Qwen3) and saves/qwen3-4b/lora/sft, trained by LLaMA-Factory's file."""
    root = tmp_path_factory.mktemp("lf")
    shutil.copytree(arch_model_dir("qwen3"), root / "models" / "Qwen3-4B-Instruct-2507")
    train_lf_file(root, "lora", "saves/qwen3-4b/lora/sft")
    return root


@pytest.fixture(scope="module")
def full_sft(workdir) -> Path:
    """saves/qwen3-4b/full/sft beside the adapter: the same file with finetuning_type full."""
    train_lf_file(workdir, "full", "saves/qwen3-4b/full/sft")
    return workdir


@pytest.mark.parametrize("name", ["qwen3_lora_sft.yaml", pytest.param("qwen3_full_sft.yaml", marks=pytest.mark.matrix),
                                  pytest.param("qwen3.yaml", marks=pytest.mark.matrix)])
def test_llamafactory_inference_file_chats(name, workdir, request):
    if "full" in name:
        request.getfixturevalue("full_sft")
    result = run_cli("chat", str(FIXTURES / "inference" / name), "--prompt", "Hello", "max_new_tokens=5",
                     "do_sample=false", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "no answer printed"


def test_llamafactory_merge_file_merges_the_adapter(workdir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = run_cli("export", str(FIXTURES / "merge_lora" / "qwen3_lora_sft.yaml"), cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    merged_dir = workdir / "saves" / "qwen3_sft_merged"
    base = AutoModelForCausalLM.from_pretrained(workdir / "models" / "Qwen3-4B-Instruct-2507")
    adapter = PeftModel.from_pretrained(base, workdir / "saves" / "qwen3-4b" / "lora" / "sft").eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    ids = torch.arange(3, 30).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapter(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    assert tokenizer.eos_token == "<|im_end|>"  # qwen3_nothink's stop token
    assert "vLLM: loadable as it is" in result.stdout


@pytest.mark.matrix
def test_llamafactory_merge_file_of_a_full_model(full_sft, workdir):
    result = run_cli("export", str(FIXTURES / "merge_lora" / "qwen3_full_sft.yaml"), "--overwrite", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (workdir / "saves" / "qwen3_sft_merged" / "model.safetensors").is_file()


@pytest.mark.matrix
def test_llamafactory_predict_file_generates_without_training(workdir):
    """LLaMA-Factory's nlg_eval file leaves do_train out (false there): shardtune only predicts with it too."""
    import json

    result = run_cli("train", str(FIXTURES / "predict" / "qwen3_lora_predict.yaml"),
                     f"dataset_dir={FIXTURES / 'data'}", "max_samples=2", "max_new_tokens=4",
                     "preprocessing_num_workers=1", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    out = workdir / "saves" / "qwen3-4b" / "lora" / "predict"
    rows = (out / "generated_predictions.jsonl").read_text().splitlines()
    assert len(rows) == 4 and all(json.loads(row)["label"] for row in rows)  # 2 samples of each eval dataset
    assert "predict_bleu-4" in json.loads((out / "predict_results.json").read_text())
    assert not (out / "adapter_model.safetensors").exists()  # nothing trained, nothing saved


def test_llamafactory_gptq_file_is_refused_with_the_reason(workdir):
    result = run_cli("export", str(FIXTURES / "merge_lora" / "qwen3_gptq.yaml"), cwd=workdir)
    assert result.returncode == 2
    assert "export_quantization_bit" in result.stderr and "GPTQ" in result.stderr
