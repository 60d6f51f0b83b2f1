"""Engine choice and the combinations refused before launch (pure: no processes)."""

from __future__ import annotations

import json

import pytest

from shardtune.config.load import build_config
from shardtune.engines.plan import plan_engine

BASE = {"model_name_or_path": "org/model", "dataset": "demo", "output_dir": "out"}


def plan(has_cuda: bool = False, world_size: int = 2, **values):
    return plan_engine(build_config({**BASE, **values}), world_size, has_cuda)


def test_engine_choice():
    assert plan(world_size=1)[0].kind == "local"
    assert plan()[0].kind == "ddp"
    assert plan(fsdp="full_shard auto_wrap")[0].kind == "fsdp"
    assert plan(fsdp_config={"fsdp_version": 1})[0].fsdp.version == 1
    chosen, problems = plan(deepspeed="z3")
    assert chosen.kind == "deepspeed" and problems == []


@pytest.mark.parametrize(("values", "has_cuda", "fragment"), [
    ({"deepspeed": "z2", "fsdp": "full_shard"}, False, "are both set; choose one engine"),
    ({"fsdp": "full_shard", "fp16": True}, True, "fp16 (true) with fsdp"),
    ({"deepspeed": "z2", "fp16": True}, False, "DeepSpeed's CPU accelerator has no fp16"),
    ({"fsdp": "full_shard offload", "fsdp_config": {"fsdp_version": 1}}, False, "fails without a GPU"),
    ({"quantization_bit": 4}, False, "needs a CUDA GPU"),
    ({"quantization_bit": 8, "fsdp": "full_shard"}, True, "8-bit bitsandbytes weights cannot be sharded"),
    ({"quantization_bit": 4, "deepspeed": "z3"}, True, "cannot be partitioned"),
    ({"deepspeed": "z9"}, False, "no such preset or file"),
])
def test_refused_combinations(values, has_cuda, fragment):
    _, problems = plan(has_cuda=has_cuda, **values)
    assert any(fragment in p for p in problems), problems


def test_qlora_with_fsdp_is_accepted_on_cuda():
    _, problems = plan(has_cuda=True, quantization_bit=4, fsdp="full_shard auto_wrap", bf16=True)
    assert problems == []


def test_pre_quantized_checkpoint_refused_for_sharding(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    _, problems = plan(has_cuda=True, model_name_or_path=str(tmp_path), fsdp="full_shard")
    assert any("pre-quantized (gptq)" in p for p in problems)
    _, problems = plan(has_cuda=True, model_name_or_path=str(tmp_path), quantization_bit=4)
    assert any("already quantized (gptq)" in p for p in problems)


def test_accelerate_config_file_as_fsdp_config():
    chosen, problems = plan(fsdp_config="examples/accelerate/fsdp_config.yaml", world_size=2)
    assert problems == [] and chosen.fsdp.version == 1 and chosen.fsdp.state_dict_type == "FULL_STATE_DICT"
    _, problems = plan(fsdp_config="examples/accelerate/fsdp_config.yaml", world_size=4)
    assert any("num_processes: 2 but this launch has 4 processes" in p for p in problems)
    _, problems = plan(fsdp_config="examples/accelerate/single_node.yaml")
    assert any("not FSDP" in p for p in problems)


def test_fsdp1_qlora_on_several_processes_is_refused():
    """A path that has never run (FSDP1 sharding frozen 4-bit units beside LoRA units) is refused, not trusted."""
    qlora = {"finetuning_type": "lora", "quantization_bit": 4, "bf16": True, "fsdp": "full_shard auto_wrap"}
    _, problems = plan(True, 2, fsdp_config={"fsdp_version": 1}, **qlora)
    assert problems == ["quantization_bit (4) with fsdp_version 1 on 2 processes: FSDP1 QLoRA has been run on one "
                        "GPU only; use fsdp_version: 2 (the default), which shards QLoRA across GPUs"]
    assert plan(True, 1, fsdp_config={"fsdp_version": 1}, **qlora)[1] == []
    assert plan(True, 2, **qlora)[1] == []
