"""An image-text LoRA SFT in bf16 on the GPU (issue 25): a tiny Qwen3-VL folder as users download it, image and
text records mixed, trained on one GPU through the real CLI. Its losses follow the same run in fp32 on the CPU (a
vision tower that did not run on the GPU, or images dropped, would move them), and the saved adapter loads onto
the folder's own image-text class."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import COMMON, losses
from tests.distributed.test_image_training import IMAGE_KEYS, TEMPLATES, rank_split_data, reloaded
from tests.gpu.helpers import needs_gpu, train

pytestmark = [*needs_gpu(), pytest.mark.timeout(900)]

FAMILY = "qwen3_vl"
BF16_AGAINST_FP32 = 3e-2  # relative, per step: bf16 weights and activations against the fp32 CPU run


def test_image_text_lora_sft_trains_in_bf16_on_the_gpu(arch_model_dir, tmp_path):
    model = arch_model_dir(f"image-text:{FAMILY}")
    data = rank_split_data(tmp_path / "data")
    keys = (*IMAGE_KEYS, f"template={TEMPLATES[FAMILY]}", f"dataset_dir={data}", "per_device_train_batch_size=4")
    gpu = train(model, tmp_path / "gpu", "lora", *keys, micro=4)
    cpu = tmp_path / "cpu"
    done = run_cli("train", *COMMON, f"model_name_or_path={model}", f"output_dir={cpu}", "finetuning_type=lora",
                   *keys, CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr[-3000:]
    assert gpu.losses == pytest.approx(losses(cpu), rel=BF16_AGAINST_FP32)
    trained = reloaded(gpu.out, model, "lora")
    declared = json.loads((model / "config.json").read_text())["architectures"][0]
    assert type(trained.get_base_model()).__name__ == declared
