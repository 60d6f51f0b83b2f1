"""``attn_implementation: varlen`` on the GPU: torch's varlen flash kernel against the dense block mask (the CPU
path's reference), forward and backward, and packed SFT through the real CLI, where ``auto`` picks it."""

from __future__ import annotations

import pytest
import torch

from shardtune.data.collator import DataCollator, block_causal_mask
from shardtune.model.varlen import varlen_attention_forward
from tests.gpu.helpers import BF16_RTOL, needs_gpu, train

pytestmark = [*needs_gpu(), pytest.mark.timeout(1200)]


class Causal(torch.nn.Module):
    is_causal = True


def packed_batch() -> dict:
    """Two rows of 256 tokens: samples of 100, 60 and 96 tokens, and of 200 plus padding."""
    rows = []
    for lengths in ((100, 60, 96), (200,)):
        segments = [s for s, n in enumerate(lengths, start=1) for _ in range(n)]
        positions = [p for n in lengths for p in range(n)]
        rows.append({"input_ids": [5] * len(segments), "labels": [5] * len(segments), "position_ids": positions,
                     "segment_ids": segments})
    return DataCollator(0, pad_to_multiple_of=256, attn_implementation="varlen")(rows)


def segments_of(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths.long()).reshape(rows, -1)


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize(("kv_heads", "value_dim"), [(8, 64), (2, 64), (8, 48)])  # MHA, GQA, MLA's narrower values
def test_the_varlen_kernel_equals_sdpa_under_the_dense_block_mask(window, kv_heads, value_dim) -> None:
    batch = packed_batch()
    offsets = batch["cu_seq_lens_q"]
    torch.manual_seed(0)
    leaves = [torch.randn(2, 8, 256, 64), torch.randn(2, kv_heads, 256, 64), torch.randn(2, kv_heads, 256, value_dim)]
    mask = block_causal_mask(segments_of(offsets, 2), as_bool=True, window=window).cuda()

    def run(kernel: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        q, k, v = (t.cuda().to(torch.bfloat16).requires_grad_() for t in leaves)
        if kernel == "varlen":
            out, _ = varlen_attention_forward(Causal(), q, k, v, None, sliding_window=window,
                                              cu_seq_lens_q=offsets.cuda(), max_length_q=batch["max_length_q"])
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=kv_heads != 8).transpose(1, 2)
        out.float().square().sum().backward()
        return out.float(), [t.grad.float() for t in (q, k, v)]

    found, found_grads = run("varlen")
    expected, expected_grads = run("dense")
    torch.testing.assert_close(found, expected, rtol=2e-2, atol=2e-2)
    for got, want in zip(found_grads, expected_grads, strict=True):
        assert float((got - want).norm() / want.norm()) < 2e-2


def test_fp32_queries_under_autocast_reach_the_kernel_in_bf16() -> None:
    batch = packed_batch()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda") for _ in range(3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = varlen_attention_forward(Causal(), q, k, v, None, cu_seq_lens_q=batch["cu_seq_lens_q"].cuda(),
                                          max_length_q=batch["max_length_q"])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_packed_sft_trains_under_varlen_with_the_dense_mask_losses(tiny_model_dir, tmp_path) -> None:
    packed = ("packing=true", "cutoff_len=512", "max_steps=4")
    auto = train(tiny_model_dir, tmp_path / "auto", "full", *packed)
    assert "[shardtune] attention: varlen" in auto.process.stdout or "flash_attention_2" in auto.results.get(
        "attn_implementation", ""), auto.process.stdout[-2000:]
    dense = train(tiny_model_dir, tmp_path / "dense", "full", *packed, "attn_implementation=sdpa")
    assert "dense [B, 1, L, L] block mask" in dense.process.stdout
    assert auto.losses == pytest.approx(dense.losses, rel=BF16_RTOL)
    lora = train(tiny_model_dir, tmp_path / "lora", "lora", *packed, "attn_implementation=varlen")
    lora_dense = train(tiny_model_dir, tmp_path / "lora-dense", "lora", *packed, "attn_implementation=sdpa")
    assert lora.losses == pytest.approx(lora_dense.losses, rel=BF16_RTOL)
