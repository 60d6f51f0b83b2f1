"""``attn_implementation: varlen`` (model/varlen.py): packed rows by sequence offsets, no dense mask.

The CPU path (SDPA's causal kernel per sample) is the reference the GPU kernel is tested against (tests/gpu), and is
checked here against the collator's dense block mask; ``auto`` takes varlen for packed bf16/fp16 rows on a CUDA GPU
where the model passes offsets on, and the checks refuse what the kernel does not compute."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune import versions
from shardtune.config.load import build_config
from shardtune.data.collator import DataCollator, block_causal_mask
from shardtune.data.settings import packs_half_rows, packs_sample_boundaries
from shardtune.engines.sequence_parallel_plan import combination_problems
from shardtune.launch.kernels_here import local_kernel_problems
from shardtune.model.attention import (
    AUTO,
    KernelSupport,
    choose_attention,
    dense_mask_fallback_warning,
    kernel_problem,
    kernel_support,
)
from shardtune.model.varlen import (
    VARLEN,
    generation_kernel,
    kernel_arguments,
    register_varlen,
    varlen_attention_forward,
)

ROWS = [{"input_ids": [5] * 7, "labels": [5] * 7, "position_ids": [0, 1, 2, 0, 1, 2, 3],
         "segment_ids": [1, 1, 1, 2, 2, 2, 2]},
        {"input_ids": [5] * 5, "labels": [5] * 5, "position_ids": [0, 1, 2, 3, 4], "segment_ids": [1] * 5}]


class Causal(torch.nn.Module):
    is_causal = True


def segments_and_offsets() -> tuple[torch.Tensor, torch.Tensor]:
    """The collator's segment numbering of two packed rows (padding a segment of its own) and its offsets."""
    batch = DataCollator(0, pad_to_multiple_of=12, attn_implementation=VARLEN)(ROWS)
    assert "attention_mask" not in batch
    offsets = batch["cu_seq_lens_q"]
    assert offsets.tolist() == [0, 3, 7, 12, 17, 24]  # 3 + 4 + padding 5 | 5 + padding 7
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).reshape(2, 12)
    return segments, offsets


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(("kv_heads", "value_dim"), [(4, 8), (2, 8), (4, 6)])  # MHA, GQA, MLA's narrower values
def test_the_cpu_path_equals_sdpa_under_the_dense_block_mask(window, kv_heads, value_dim) -> None:
    segments, offsets = segments_and_offsets()
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 12, 8), torch.randn(2, kv_heads, 12, 8)
    v = torch.randn(2, kv_heads, 12, value_dim)
    mask = block_causal_mask(segments, as_bool=True, window=window)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                                                 enable_gqa=kv_heads != 4).transpose(1, 2)
    found, weights = varlen_attention_forward(Causal(), q, k, v, None, scaling=0.3, sliding_window=window,
                                              cu_seq_lens_q=offsets, max_length_q=7)
    assert weights is None and found.shape == (2, 12, 4, value_dim)
    torch.testing.assert_close(found, reference, rtol=1e-5, atol=1e-5)


def test_unpacked_rows_get_offsets_a_row_then_its_padding() -> None:
    rows = [{"input_ids": [5] * 4, "labels": [5] * 4}, {"input_ids": [5] * 6, "labels": [5] * 6}]
    batch = DataCollator(0, attn_implementation=VARLEN)(rows)
    assert "attention_mask" not in batch and batch["cu_seq_lens_q"].tolist() == [0, 4, 6, 12]


def test_rows_without_offsets_are_one_causal_sequence_each_unless_positions_restart() -> None:
    """Whole rows from outside the collator (DDP's gradient probe) take no offsets; packed rows whose offsets a
    model dropped on the way to this layer (positions start again inside a row) are refused, never mixed."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 9, 4) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    found, _ = varlen_attention_forward(Causal(), q, k, v, None, position_ids=torch.arange(9).expand(3, 9))
    torch.testing.assert_close(found, reference, rtol=1e-5, atol=1e-5)
    packed_positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]).expand(3, 9)
    with pytest.raises(RuntimeError, match="without their sample offsets"):
        varlen_attention_forward(Causal(), q, k, v, None, position_ids=packed_positions)


def test_what_the_kernel_does_not_compute_is_refused() -> None:
    q = torch.randn(1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="KV cache"):
        varlen_attention_forward(Causal(), q[:, :, :1], q, q, None)
    with pytest.raises(RuntimeError, match="dropout"):
        varlen_attention_forward(Causal(), q, q, q, None, dropout=0.1)
    with pytest.raises(RuntimeError, match="softcapping"):
        varlen_attention_forward(Causal(), q, q, q, None, softcap=50.0)


def test_fp32_queries_under_autocast_are_cast_as_autocast_would() -> None:
    """RoPE leaves queries in fp32 under autocast; the GPU kernel takes bf16/fp16 only."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found, _ = varlen_attention_forward(Causal(), q, k, v, None)
    assert found.dtype == torch.bfloat16
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(found.float(), reference, rtol=2e-2, atol=2e-2)


def tiny_llama(kernel: str) -> LlamaForCausalLM:
    register_varlen()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM._from_config(config, attn_implementation=kernel).eval()


def test_a_model_trained_under_varlen_generates_under_sdpa_and_goes_back() -> None:
    varlen, sdpa = tiny_llama(VARLEN), tiny_llama("sdpa")
    prompts = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])  # left padding: needs the mask varlen never sees
    mask = (prompts != 0).long()
    with torch.no_grad():
        expected = sdpa.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=4, do_sample=False)
        with generation_kernel(varlen):
            assert varlen.config._attn_implementation == "sdpa"
            found = varlen.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(found, expected)
    assert varlen.config._attn_implementation == VARLEN
    with pytest.raises(RuntimeError, match="without their sample offsets"), torch.no_grad():
        varlen.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=2, do_sample=False)


def support(**changes) -> KernelSupport:
    found = kernel_support({"model_type": "llama"})
    assert found is not None and found.flash and found.attention_interface
    return KernelSupport(**{**found.__dict__, **changes})


def test_auto_takes_varlen_for_packed_half_rows_on_a_gpu_without_flash_attn() -> None:
    chosen = choose_attention(AUTO, support(), flash_usable=False, model="m", varlen_usable=True)
    assert chosen.kernel == VARLEN and "varlen" in chosen.reason
    assert choose_attention(AUTO, support(), flash_usable=True, model="m", varlen_usable=True).kernel \
        == "flash_attention_2"
    assert choose_attention(AUTO, support(), flash_usable=False, model="m").kernel == "sdpa"
    assert choose_attention(AUTO, support(), flash_usable=False, model="m", varlen_usable=True,
                            splits_sequences=True).kernel == "sdpa"
    for blocked in ({"flash": False}, {"attention_interface": False}, {"sinks": True}, {"softcap": True},
                    {"attention_dropout": True}, {"image_text": True}, {"bidirectional": True}):
        assert choose_attention(AUTO, support(**blocked), flash_usable=False, model="m",
                                varlen_usable=True).kernel != VARLEN, blocked


def test_the_model_checks_say_why_varlen_cannot_run() -> None:
    assert kernel_problem(VARLEN, support(), "m") is None
    assert "not known before loading" in (kernel_problem(VARLEN, None, "m") or "")  # remote code: not checkable
    gemma2 = kernel_support({"model_type": "gemma2"})
    assert gemma2 is not None and gemma2.softcap
    assert "softcaps" in (kernel_problem(VARLEN, gemma2, "m") or "")
    assert "sinks" in (kernel_problem(VARLEN, kernel_support({"model_type": "gpt_oss"}), "m") or "")
    dropping = kernel_support({"model_type": "llama", "attention_dropout": 0.1})
    assert "attention_dropout" in (kernel_problem(VARLEN, dropping, "m") or "")


def test_packed_rows_and_precision_decide_where_auto_may_take_varlen() -> None:
    sft = build_config({"stage": "sft", "packing": True, "bf16": True})
    assert packs_sample_boundaries(sft) and packs_half_rows(sft)
    assert not packs_half_rows(build_config({"stage": "sft", "packing": True}))  # fp32: no flash kernel
    assert not packs_sample_boundaries(build_config({"stage": "pt", "bf16": True}))  # one text cut into rows
    assert packs_sample_boundaries(build_config({"stage": "pt", "padding_free": True}))


def test_runs_varlen_cannot_take_are_refused_before_launch(tiny_model_dir) -> None:
    fp32 = build_config({"model_name_or_path": str(tiny_model_dir), "attn_implementation": VARLEN})
    assert local_kernel_problems(fp32, visible_gpus=0) == []  # the CPU path takes fp32
    [problem] = local_kernel_problems(fp32, visible_gpus=1)
    assert "bf16 or fp16" in problem
    split = build_config({"model_name_or_path": str(tiny_model_dir), "attn_implementation": VARLEN,
                          "sequence_parallel_size": 2})
    [problem] = combination_problems(split)  # the sequence-parallel table owns the refusal
    assert "sequence_parallel_size (2)" in problem and "attn_implementation" in problem


def test_packed_rows_on_a_gpu_without_an_offsets_kernel_are_warned_about() -> None:
    assert dense_mask_fallback_warning(True, True, "sdpa") is not None
    assert "varlen" in (dense_mask_fallback_warning(True, True, "eager") or "")
    for kernel in ("flash_attention_2", VARLEN):
        assert dense_mask_fallback_warning(True, True, kernel) is None
    assert dense_mask_fallback_warning(True, False, "sdpa") is None
    assert dense_mask_fallback_warning(False, True, "sdpa") is None


def test_an_older_varlen_attn_gets_the_scale_and_heads_on_its_inputs() -> None:
    """torch 2.10's varlen_attn has no scale, GQA or window keywords (the GPU machines run their own torch): the
    scale is folded into the queries and the key-value heads repeated, which SDPA shows is the same attention."""
    newest = frozenset({"window_size", "scale", "enable_gqa"})
    first = frozenset({"is_causal"})
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    _, _, _, options = kernel_arguments(newest, q, k, v, 0.3, 5)
    assert options == {"window_size": (4, 0), "scale": 0.3, "enable_gqa": True}
    assert kernel_arguments(newest, q, k, v, None, None)[3] == {"window_size": (-1, 0), "enable_gqa": True}
    q1, k1, v1, options = kernel_arguments(first, q, k, v, 0.3, None)
    assert options == {"is_causal": True} and k1.shape == v1.shape == (10, 4, 8)

    def attend(q, k, v, **extra):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, **extra)

    torch.testing.assert_close(attend(q1, k1, v1), attend(q, k, v, scale=0.3, enable_gqa=True), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(RuntimeError, match="sliding windows"):
        kernel_arguments(first, q, k, v, None, 5)


def test_a_torch_without_varlen_attn_is_refused_on_a_gpu(monkeypatch) -> None:
    from shardtune.model import attention

    assert attention.varlen_device_problem(VARLEN, has_cuda=True, half_precision=True) is None
    monkeypatch.setattr(versions, "installed_version", lambda name: "2.9.1+cu128")
    problem = attention.varlen_device_problem(VARLEN, has_cuda=True, half_precision=True)
    assert problem is not None and "2.9.1+cu128 lacks" in problem
    assert attention.varlen_device_problem(VARLEN, has_cuda=False, half_precision=False) is None
    assert choose_attention(AUTO, support(), flash_usable=False, model="m",
                            varlen_usable=versions.varlen_attn_available()).kernel == "sdpa"


@pytest.mark.matrix  # about a minute of inductor compilation on 2 cores: make test-matrix
def test_compiled_decoder_layers_under_varlen_give_the_eager_losses_and_gradient_norms() -> None:
    """torch_compile (regional, model/compile.py) over varlen's CPU path: the per-sample loop breaks the graph, and
    the result must still be the eager one."""
    import copy

    from shardtune.model.compile import apply_regional_compile
    from tests.unit.test_packing_architectures import packed_rows

    eager = tiny_llama(VARLEN).train()
    compiled = copy.deepcopy(eager)
    assert apply_regional_compile(compiled, "default", "inductor") == 2
    batch = DataCollator(0, attn_implementation=VARLEN)(packed_rows(64))  # the tiny model's vocabulary
    inputs = {k: v for k, v in batch.items() if k != "num_tokens"}
    found = []
    for model in (eager, compiled):
        losses, norms = [], []
        for _ in range(2):
            loss = model(**inputs, use_cache=False).loss
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            losses.append(float(loss))
            model.zero_grad()
        found.append((losses, norms))
    assert found[1][0] == pytest.approx(found[0][0], rel=1e-5)
    assert found[1][1] == pytest.approx(found[0][1], rel=1e-4)
