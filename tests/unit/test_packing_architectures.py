"""Packed rows stay isolated under every attention variant: each packed sample's logits equal running it alone.

Tiny models of each family (tests/conftest.py ``arch_model_dir``) with 16-token sliding windows, and samples
longer than the window, so a mask that forgot the window (or the boundaries) changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardtune.data.collator import DataCollator
from shardtune.data.packing import pack_row
from shardtune.model.architectures import SLIDING_WINDOW
from shardtune.model.attention import AUTO, choose_attention, kernel_support, layer_windows
from shardtune.model.folder import read_config_json
from shardtune.model.varlen import VARLEN, register_varlen

ROWS = ((23, 18, 7), (30, 9))  # sample lengths per packed row; the second row is padded to the first's length
# The kernel `auto` picks on a machine without flash-attn (this CPU stack), per family.
AUTO_ON_CPU = {"mistral": "sdpa", "gemma2": "eager", "gemma3": "sdpa", "gpt_oss": "eager", "deepseek_v3": "sdpa"}


def packed_rows(vocab_size: int) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for lengths in ROWS:
        samples = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]
        rows.append(pack_row(samples, samples))
    return rows


def samples_of(row: dict[str, list[int]]) -> list[tuple[int, int]]:
    """(start, end) of each sample in a packed row."""
    bounds: dict[int, list[int]] = {}
    for index, segment in enumerate(row["segment_ids"]):
        bounds.setdefault(segment, []).append(index)
    return [(found[0], found[-1] + 1) for found in bounds.values()]


def load(model_dir: Path, kernel: str) -> Any:
    if kernel == VARLEN:
        register_varlen()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=kernel, dtype=torch.float32)
    return model.eval()


def largest_difference(model: Any, collator: DataCollator, alone_kernel: str | None = None,
                       vocab_size: int | None = None) -> float:
    """The largest |packed - alone| logit difference over every sample of every row; ``alone_kernel``: the samples
    alone run under that kernel (the same model switched to it), else under the packed run's. ``vocab_size``: for
    a config that nests it (the model's config.vocab_size otherwise)."""
    rows = packed_rows(vocab_size or model.config.vocab_size)
    batch = collator(rows)
    # The mask, or under varlen the offsets (cu_seq_lens_q/k, max_length_q/k) in its place.
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_tokens")}
    worst = 0.0
    with torch.no_grad():
        packed = model(**inputs, use_cache=False).logits
        if alone_kernel is not None:
            model.set_attn_implementation(alone_kernel)
        for r, row in enumerate(rows):
            for start, end in samples_of(row):
                alone = model(input_ids=torch.tensor([row["input_ids"][start:end]]), use_cache=False).logits
                worst = max(worst, float((packed[r, start:end] - alone[0]).abs().max()))
    return worst


@pytest.mark.parametrize("arch", list(AUTO_ON_CPU))
def test_auto_picks_a_kernel_the_family_supports(arch: str, arch_model_dir) -> None:
    support = kernel_support(read_config_json(arch_model_dir(arch)) or {})
    assert choose_attention(AUTO, support, flash_usable=False, model=arch).kernel == AUTO_ON_CPU[arch]


@pytest.mark.parametrize(("arch", "kernel"), [*AUTO_ON_CPU.items(), ("mistral", "eager"), ("gemma3", "eager"),
                                               ("deepseek_v3", "eager"), ("mistral", VARLEN), ("gemma3", VARLEN),
                                               ("deepseek_v3", VARLEN)])
def test_each_packed_sample_equals_running_it_alone(arch: str, kernel: str, arch_model_dir) -> None:
    model = load(arch_model_dir(arch), kernel)
    assert max(max(lengths) for lengths in ROWS) > SLIDING_WINDOW  # samples longer than the window
    collator = DataCollator(0, attn_implementation=kernel, window_by_layer_type=layer_windows(model.config))
    assert largest_difference(model, collator) < 1e-4


@pytest.mark.parametrize(("arch", "kernel"), [("mistral", "sdpa"), ("gemma3", "sdpa"), ("gpt_oss", "eager")])
def test_a_mask_without_the_window_would_leak(arch: str, kernel: str, arch_model_dir) -> None:
    """The check above can fail: sample boundaries alone (no window) change the sliding layers' logits."""
    model = load(arch_model_dir(arch), kernel)
    assert largest_difference(model, DataCollator(0, attn_implementation=kernel)) > 1e-3


def test_hybrid_models_get_one_mask_per_layer_type(arch_model_dir) -> None:
    config = read_config_json(arch_model_dir("gemma2")) or {}
    windows = layer_windows(config)
    assert windows == {"sliding_attention": SLIDING_WINDOW, "full_attention": None}
    batch = DataCollator(0, attn_implementation="eager", window_by_layer_type=windows)(packed_rows(100))
    masks = batch["attention_mask"]
    assert set(masks) == set(windows)
    allowed = masks["sliding_attention"][0, 0] == 0
    assert allowed[22].sum() == SLIDING_WINDOW and (masks["full_attention"][0, 0][22] == 0).sum() == 23
    assert layer_windows(read_config_json(arch_model_dir("mistral")) or {}) == {"sliding_attention": SLIDING_WINDOW}
    assert layer_windows(read_config_json(arch_model_dir("deepseek_v3")) or {}) == {"full_attention": None}


def varlen_reference(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                     scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """What flash-attn's varlen kernel computes, in plain torch: causal attention within each sequence of the
    flattened batch (``cu_seq_lens_q``), each layer's own window (flash's ``window_size``: the query and the
    ``sliding_window - 1`` tokens before it) and logit soft-capping. No dense mask is used."""
    assert cu_seq_lens_q is not None, "the collator's varlen offsets must reach every attention layer"
    batch, heads, length, _ = query.shape
    key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    flat = [t.transpose(1, 2).reshape(batch * length, heads, t.shape[-1]) for t in (query, key, value)]
    out = flat[0].new_empty(batch * length, heads, value.shape[-1])
    offsets = cu_seq_lens_q.tolist()
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        q, k, v = (t[start:end].transpose(0, 1) for t in flat)
        scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        if sliding_window is not None:
            allowed &= torch.ones_like(allowed).triu(-(sliding_window - 1))
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[start:end] = (probs @ v).transpose(0, 1)
    return out.reshape(batch, length, heads, -1), None


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "deepseek_v3"])
def test_flash_varlen_offsets_isolate_sliding_and_hybrid_layers(arch: str, arch_model_dir) -> None:
    """On a GPU `auto` picks flash_attention_2 for these families: packed rows then carry varlen offsets and no
    mask, and each layer brings its own window. Run here through a reference varlen kernel registered with
    transformers (flash-attn needs CUDA): every packed sample equals the sample run alone with the model's own
    (eager) attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register("varlen_window_reference", varlen_reference)
    ALL_MASK_ATTENTION_FUNCTIONS.register("varlen_window_reference", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    model_dir = arch_model_dir(arch)
    packed_model, alone_model = load(model_dir, "varlen_window_reference"), load(model_dir, "eager")
    rows = packed_rows(packed_model.config.vocab_size)
    batch = DataCollator(0, attn_implementation="flash_attention_2",
                         window_by_layer_type=layer_windows(packed_model.config))(rows)
    assert "attention_mask" not in batch
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_tokens")}
    with torch.no_grad():
        packed = packed_model(**inputs, use_cache=False).logits
        for r, row in enumerate(rows):
            for start, end in samples_of(row):
                alone = alone_model(input_ids=torch.tensor([row["input_ids"][start:end]]), use_cache=False).logits
                assert torch.allclose(packed[r, start:end], alone[0], atol=1e-4), (arch, r, start)
