"""FSDP1 with units that train nothing (QLoRA's decoder layers beside their LoRA units), unsharded.

On one process FSDP1 turns FULL_SHARD into NO_SHARD. With original parameters it then loses the weights of a
wholly frozen unit from every state dict after a backward (seen on a GPU with QLoRA: the adapter save failed
with "FSDP assumes ...base_layer.weight is in the state_dict"). The same layout in bf16 without 4-bit weights
shows it on CPU: one gloo process, LoRA units wrapped apart from frozen decoder layers, one training step, then
the full state dict must hold every weight and the adapter-only one every LoRA weight.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.distributed.helpers import run_under_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_fsdp1_frozen_units_keep_their_weights_in_state_dicts(tiny_model_dir, tmp_path):
    run_under_torchrun(Path(__file__), 1, "--model", str(tiny_model_dir), "--out", str(tmp_path / "result.json"),
                       timeout=240)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["missing_from_full"] == []
    assert result["adapter_keys"] and all(".lora_" in key for key in result["adapter_keys"])
    assert result["adapter_keys"] == result["trainable"]


def worker(model_dir: str, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from shardtune.engines.engine_plan import FsdpSettings
    from shardtune.engines.fsdp import wrap_fsdp1
    from shardtune.engines.fsdp_qlora import fsdp1_lora_units, unify_dtypes
    from shardtune.model.finetuning.apply import apply_finetuning
    from shardtune.model.finetuning.settings import FinetuningSettings

    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = apply_finetuning(model, FinetuningSettings(finetuning_type="lora"))
    unify_dtypes(model, torch.bfloat16)  # frozen bf16, LoRA fp32: as prepare_qlora_for_fsdp leaves a 4-bit model
    names = [name for name, _ in model.named_parameters()]
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    fsdp = wrap_fsdp1(model, FsdpSettings(version=1), init_device_mesh("cpu", (1,)), torch.device("cpu"),
                      extra_units=fsdp1_lora_units(model))
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fsdp(input_ids=ids, labels=ids).loss.backward()
    full = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True))
    adapter = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    out.write_text(json.dumps({"missing_from_full": [n for n in names if n not in full],
                               "adapter_keys": sorted(adapter), "trainable": trainable}))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    worker(args.model, args.out)
