"""fp8: torchao's float8 swap takes the intended Linear layers only, keeps the weights' names, trains (torch 2.13 runs
float8 matmuls on the CPU too), its keys and engines are checked before launch, and a rank without a float8 GPU
refuses with one line. The GPU tier (tests/gpu/test_kernels_gpu.py) trains it through the CLI."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from shardtune.config.schema import TrainConfig
from shardtune.engines.plan import plan_engine
from shardtune.model.fp8 import float8_device_problem, float8_key_problems
from shardtune.train.loop import train_step
from tests.conftest import run_cli
from tests.unit.test_chunked_loss import batch_of, features, tiny_llama
from tests.unit.test_loop import make_engine

needs_torchao = pytest.mark.skipif(not __import__("importlib").util.find_spec("torchao"),
                                   reason="torchao is not installed (pip install 'shardtune[fp8]')")
# hidden 32, 2 kv heads of 8 (k/v 16 wide): the attention projections are 16-aligned; the MLP's 72 is not.
UNALIGNED_MLP = {"intermediate_size": 72}


def converted(model: torch.nn.Module, fsdp_all_gather: bool = False):
    from shardtune.model.fp8 import apply_float8_training

    return apply_float8_training(model, fsdp_all_gather)


def layer_kinds(model: torch.nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@needs_torchao
def test_the_aligned_projections_swap_and_the_head_and_unaligned_layers_stay():
    model = tiny_llama(**UNALIGNED_MLP)
    report = converted(model)
    kinds = layer_kinds(model)
    float8 = sorted(n for n, kind in kinds.items() if kind == "Float8Linear")
    assert float8 == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo")
    assert kinds["lm_head"] == "Linear" and kinds["model.layers.0.mlp.down_proj"] == "Linear"
    assert report.converted == 8
    assert ("lm_head", "output head") in report.kept
    assert ("model.layers.1.mlp.up_proj", "sizes not multiples of 16") in report.kept
    assert report.line() == ("[shardtune] fp8: 8 Linear layers train in float8 (torchao); kept in bf16: "
                             "model.layers.0.mlp.gate_proj and 5 more (sizes not multiples of 16); lm_head (output "
                             "head)")


@needs_torchao
def test_the_swap_on_a_meta_skeleton_keeps_every_weight_name_for_the_loaders():
    from shardtune.model.fp8 import float8_all_gathers

    with torch.device("meta"):
        model = tiny_llama()
    names = list(model.state_dict())
    converted(model, fsdp_all_gather=True)
    assert list(model.state_dict()) == names
    assert float8_all_gathers(model)
    assert all(p.is_meta for p in model.parameters())


@needs_torchao
def test_float8_layers_train_close_to_the_high_precision_model():
    model = tiny_llama()
    runs = {}
    for name in ("plain", "fp8"):
        copy_ = copy.deepcopy(model)
        if name == "fp8":
            assert converted(copy_).converted == 14  # 7 Linear layers in each of 2 decoder layers
        engine = make_engine(copy_, optim="adamw_torch", lr=1e-2)
        runs[name] = [train_step(engine, [batch_of(features(seed=step))], max_grad_norm=1.0)["loss"]
                      for step in range(3)]
    assert all(math.isfinite(x) for x in runs["fp8"])
    assert runs["fp8"] != runs["plain"]  # the float8 casts round: the swapped layers did run
    assert runs["fp8"] == pytest.approx(runs["plain"], rel=2e-2)


@pytest.mark.parametrize(("keys", "fragment"), [
    ({"fp8_backend": "te"}, "fp8_backend (te): shardtune's float8 training is torchao's"),
    ({"bf16": False}, "fp8 (true) with bf16 (false) / fp16 (false)"),
    ({"quantization_bit": 4}, "fp8 (true) with quantization_bit (4)"),
    ({"finetuning_type": "lora"}, "fp8 (true) with finetuning_type (lora)"),
])
def test_keys_fp8_cannot_go_with_are_refused_by_name(keys, fragment):
    c = TrainConfig(**{"fp8": True, "bf16": True, "finetuning_type": "full", **keys})
    problems = float8_key_problems(c)
    assert len(problems) == 1 and fragment in problems[0], problems


def test_the_all_gather_switch_turns_fp8_on_as_in_llamafactory():
    c = TrainConfig(fp8_enable_fsdp_float8_all_gather=True, bf16=False, finetuning_type="full")
    assert float8_key_problems(c) == [
        "fp8_enable_fsdp_float8_all_gather (true, which turns fp8 on) with bf16 (false) / fp16 (false): the layers "
        "fp8 leaves in high precision (output head, norms, unaligned layers) compute in bf16; set bf16: true (and "
        "fp16: false)"]
    assert float8_key_problems(TrainConfig(bf16=True, finetuning_type="full", fp8=True)) == []


@pytest.mark.parametrize(("engine_keys", "fragment"), [
    ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 1}}, "fp8 (true) with fsdp (fsdp_version 1)"),
    ({"fp8_enable_fsdp_float8_all_gather": True}, "fp8_enable_fsdp_float8_all_gather (true) with ddp: only FSDP2"),
    ({"fp8_enable_fsdp_float8_all_gather": True, "deepspeed": "z3"},
     "fp8_enable_fsdp_float8_all_gather (true) with DeepSpeed ZeRO-3: only FSDP2"),
])
def test_engines_refuse_what_they_cannot_do_with_float8(engine_keys, fragment):
    c = TrainConfig(model_name_or_path="m", fp8=True, bf16=True, finetuning_type="full", **engine_keys)
    _, problems = plan_engine(c, world_size=2, has_cuda=False)
    assert any(fragment in p for p in problems), problems


@pytest.mark.parametrize("engine_keys", [
    {}, {"deepspeed": "z3"}, {"deepspeed": "z2"},
    {"fsdp": "full_shard auto_wrap", "fp8_enable_fsdp_float8_all_gather": True},
])
def test_ddp_zero_and_fsdp2_take_float8(engine_keys):
    c = TrainConfig(model_name_or_path="m", fp8=True, bf16=True, finetuning_type="full", **engine_keys)
    _, problems = plan_engine(c, world_size=2, has_cuda=False)
    assert not [p for p in problems if "fp8" in p], problems


def test_a_rank_without_a_float8_gpu_says_why_in_one_line():
    assert float8_device_problem(False, None, True).startswith("fp8 (true) needs a CUDA GPU of compute capability "
                                                               "8.9+")
    assert "this GPU has compute capability 8.0" in float8_device_problem(True, (8, 0), True)
    assert "pip install 'shardtune[fp8]'" in float8_device_problem(True, (9, 0), False)
    assert float8_device_problem(True, (8, 9), True) is None
    assert float8_device_problem(True, (9, 0), True) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a rank without CUDA")
def test_training_on_a_cpu_refuses_in_one_line_after_check_passed(tiny_model_dir, tmp_path):
    args = ("examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path}",
            "fp8=true", "bf16=true", "max_steps=1")
    assert run_cli("check", *args).returncode == 0
    done = run_cli("train", *args)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "shardtune: error: fp8 (true) needs a CUDA GPU of compute capability 8.9+ (H100, L4, RTX 4090; float8 tensor "
        "cores); none is visible here. Remove fp8 to train in bf16")


@pytest.mark.parametrize("keys", [{}, {"packing": True, "neat_packing": True, "cutoff_len": 50}])
def test_fp8_batches_hold_a_multiple_of_16_tokens(keys, tiny_model_dir):
    """The weight gradient's float8 matmul contracts over the micro-batch's tokens: on an H100 a batch of 156 tokens
    failed with "trailing dimension of mat1 ... divisible by 16" (2026-11-28). Rows are padded to 16 under fp8."""
    from types import SimpleNamespace

    from shardtune.train.setup import build_collator

    tokenizer = SimpleNamespace(pad_token_id=0)
    rows = [{"input_ids": list(range(1, 8)), "labels": list(range(1, 8))},
            {"input_ids": list(range(1, 11)), "labels": list(range(1, 11))}]
    base = {"bf16": True, "finetuning_type": "full", "attn_implementation": "sdpa",
            "model_name_or_path": str(tiny_model_dir), **keys}
    plain = build_collator(tokenizer, TrainConfig(**base))(rows)
    fp8 = build_collator(tokenizer, TrainConfig(fp8=True, **base))(rows)
    assert fp8["input_ids"].numel() % 16 == 0 and fp8["input_ids"].shape[-1] % 16 == 0
    assert fp8["input_ids"].shape[-1] > plain["input_ids"].shape[-1]  # the plain run is not padded
    assert int(fp8["num_tokens"]) == int(plain["num_tokens"]) == 17  # padding is not counted as trained


@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_under_sequence_parallelism_gives_every_rank_a_multiple_of_16_tokens(rows, tiny_model_dir):
    """Each rank multiplies its own slice of the rows, so the slice, not the whole row, must hold a multiple of 16
    tokens: rows padded to lcm(16, 2) = 16 left one row of 7 tokens as two slices of 8."""
    from types import SimpleNamespace

    from shardtune.train.sequence_shards import sequence_shard
    from shardtune.train.setup import build_collator

    features = [{"input_ids": list(range(1, 8 + n)), "labels": list(range(1, 8 + n))} for n in range(rows)]
    config = TrainConfig(fp8=True, bf16=True, finetuning_type="full", attn_implementation="sdpa",
                         model_name_or_path=str(tiny_model_dir), sequence_parallel_size=2)
    batch = build_collator(SimpleNamespace(pad_token_id=0), config)(features)
    for index in range(2):
        shard = sequence_shard(batch, 2, index)
        assert shard["input_ids"].shape[-1] % 16 == 0 and shard["input_ids"].numel() % 16 == 0
