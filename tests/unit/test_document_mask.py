"""Packed rows through FlexAttention's block mask (model/attention.py document_block_mask) against the collator's
dense block-diagonal mask under SDPA, the CPU reference: the same outputs, with and without a sliding window.
FlexAttention's forward runs on the CPU in torch 2.13, so the document-mask logic is checked here."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from shardtune.data.collator import DataCollator, block_causal_mask
from shardtune.model.attention import dense_mask_fallback_warning, document_block_mask


def packed_segments() -> torch.Tensor:
    rows = [{"input_ids": [1] * 7, "labels": [1] * 7, "position_ids": [0, 1, 2, 0, 1, 2, 3],
             "segment_ids": [1, 1, 1, 2, 2, 2, 2]},
            {"input_ids": [1] * 5, "labels": [1] * 5, "position_ids": [0, 1, 2, 3, 4], "segment_ids": [1] * 5}]
    batch = DataCollator(0, pad_to_multiple_of=16, attn_implementation="sdpa")(rows)
    # The collator's numbering, padding included (a segment of its own): recovered from the dense mask's rows.
    dense = batch["attention_mask"][:, 0]
    return torch.stack([torch.unique_consecutive(row.int().argmax(dim=1), return_inverse=True)[1] for row in dense])


@pytest.mark.parametrize("window", [None, 2])
def test_flex_document_mask_matches_the_dense_block_mask(window):
    segments = packed_segments()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    dense = block_causal_mask(segments, as_bool=True, window=window)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    # torch 2.13 runs FlexAttention's forward on the CPU (its backward needs a GPU: tests/gpu).
    found = flex_attention(q, k, v, block_mask=document_block_mask(segments, window))
    torch.testing.assert_close(found, reference, rtol=1e-5, atol=1e-5)


def test_segments_never_see_each_other():
    segments = packed_segments()
    mask = document_block_mask(segments).to_dense()  # block granularity: 1 where a block may attend
    assert mask.shape[-2:] == (1, 1)  # 16 tokens in one 128-token block: the kernel computes it whole, masked
    dense = block_causal_mask(segments, as_bool=True)
    assert not bool(dense[0, 0, 4, 1])  # the second sample's first token does not see the first sample


def test_packed_rows_on_a_gpu_without_varlen_kernel_are_warned_about():
    assert dense_mask_fallback_warning(True, True, "sdpa") is not None
    assert dense_mask_fallback_warning(True, True, "flash_attention_2") is None
    assert dense_mask_fallback_warning(True, False, "sdpa") is None
    assert dense_mask_fallback_warning(False, True, "sdpa") is None
