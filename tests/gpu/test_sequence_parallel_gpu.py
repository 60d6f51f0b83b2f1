"""The split attention's kernel path on a GPU: each segment of a packed row goes through sdpa's flash backend (no
mask), and the result equals the whole row's block-causal attention.

One GPU cannot hold two NCCL ranks, so this checks the per-segment attention every rank runs (the exchanges are
checked on CPU processes in tests/distributed/test_sequence_parallel*.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class _Attention(torch.nn.Module):
    """What transformers' sdpa_attention_forward reads from an attention module."""

    num_key_value_groups = 1  # as many KV heads as heads: flash takes GQA only through enable_gqa
    is_causal = True


def test_segments_take_the_flash_kernel_and_equal_the_block_causal_row():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from shardtune.data.collator import block_causal_mask
    from shardtune.engines.sequence_parallel import segment_attention
    from shardtune.train.sequence_shards import segment_spans

    torch.manual_seed(0)
    segments = torch.tensor([[1] * 700 + [2] * 1200 + [3] * 96 + [0] * 52])  # three samples and padding
    length = segments.shape[1]
    query = torch.randn(1, 8, length, 64, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(1, 8, length, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    module = _Attention()
    spans = [segment_spans(row) for row in segments]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # a mask would leave flash no way to run: an error here
        split = segment_attention(module, query, key, value, spans, 0, 0.0, None, None)
    mask = block_causal_mask(segments, as_bool=True).cuda()
    whole, _ = sdpa_attention_forward(module, query, key, value, mask, is_causal=False)
    assert split.shape == whole.shape
    torch.testing.assert_close(split.float(), whole.float(), atol=2e-2, rtol=2e-2)
