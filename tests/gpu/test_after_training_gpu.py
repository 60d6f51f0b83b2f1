"""`chat` and `do_predict` on the GPU with a bf16 model: the model is loaded in its checkpoint's dtype (bf16) on the
GPU, answers stop at the template's stop token, and predictions under ZeRO-3 on the GPUs equal one GPU's."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.e2e.test_after_training import PAIRS, bf16_copy, parrot_args, parrot_data
from tests.gpu.helpers import GPUS, needs_gpu

pytestmark = [*needs_gpu(), pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def gpu_parrot(tiny_model_dir, tmp_path_factory):
    """The tiny model in bf16, fully fine-tuned in bf16 on the GPU until it repeats four answers, with do_predict."""
    root = tmp_path_factory.mktemp("gpu-parrot")
    base = bf16_copy(tiny_model_dir, root / "tiny-bf16")
    out = root / "out"
    result = run_cli(*parrot_args(base, parrot_data(root / "data"), out, "bf16=true", "max_steps=60"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_do_predict_on_the_gpu_in_bf16(gpu_parrot):
    results = json.loads((gpu_parrot / "predict_results.json").read_text())
    assert results["predict_samples"] == 4 and results["predict_exact_match"] == 100.0, results
    assert json.loads((gpu_parrot / "config.json").read_text())["dtype"] == "bfloat16"


def test_chat_on_the_gpu_in_bf16(gpu_parrot):
    result = run_cli("chat", str(gpu_parrot), "--prompt", PAIRS[0][0], "do_sample=false", "infer_dtype=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == PAIRS[0][1]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_zero3_predictions_on_gpus_equal_one_gpu(gpu_parrot, tmp_path):
    runs = {}
    for name, env, extra in (("one", {}, ()), ("zero3", {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"},
                                                   ("deepspeed=z3",))):
        out = tmp_path / name
        result = run_cli("eval", str(gpu_parrot), f"output_dir={out}", "do_sample=false", "max_new_tokens=16",
                         "per_device_eval_batch_size=1", *extra, **env)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = (out / "generated_predictions.jsonl").read_text()
    assert runs["zero3"] == runs["one"]
