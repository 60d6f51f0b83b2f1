"""``attn_implementation: varlen``: packed rows attend by sequence offsets, with no ``[B, 1, L, L]`` mask.

On a CUDA GPU this is torch's own ``torch.nn.attention.varlen.varlen_attn`` (the FlashAttention-2 kernel inside
torch: no flash-attn package to build), fed the collator's offsets (``cu_seq_lens_q``, the same kwargs
transformers passes flash-attn's varlen kernel). On the CPU, where torch has no varlen kernel, each sample runs
through SDPA's causal kernel on its own: the reference the GPU kernel is tested against, and the same arithmetic
as the dense block mask (tests/unit/test_varlen_attention.py).

transformers calls the function through its attention interface (registered here under ``varlen``) for models
whose attention modules pass the forward's kwargs on, the ones that support flash attention. It builds no mask
for a kernel it has no mask function for, so the function sees the offsets and never a mask:
* packed rows: the offsets the collator made from the sample boundaries (padding is a sample of its own);
* unpacked rows: offsets too, a row and then its padding (the collator gives every batch offsets under varlen);
* no offsets (whole rows from elsewhere, DDP's gradient probe): each row is one causal sequence, unless the
  positions show packed rows whose offsets the model dropped on the way (refused: ``whole_row_offsets``);
* generation (a KV cache, left padding) cannot be told apart from that without the mask, so ``generation_kernel``
  switches the model to sdpa while it generates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from shardtune.data.settings import VARLEN
from shardtune.versions import varlen_attn_keywords


def register_varlen() -> None:
    """Make ``attn_implementation="varlen"`` loadable in this process (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` ``[B, H, L, D]``, ``key``/``value`` ``[B, H_kv, L, D]``;
    returns ``[B, L, H, D_v]`` and no weights."""
    batch, heads, length, _ = query.shape
    problem = unsupported_call(module, query, key, dropout, softcap)
    if problem:
        raise RuntimeError(f"attn_implementation varlen: {problem}")
    offsets = kwargs.get("cu_seq_lens_q")
    longest: int = kwargs.get("max_length_q") or length  # a bound: the kernel only sizes its grid by it
    if offsets is None:
        offsets = whole_row_offsets(module, kwargs.get("position_ids"), batch, length, query.device)
    query, key, value = compute_dtype(query, key, value)
    window = sliding_window if sliding_window is not None and sliding_window < length else None
    if not query.is_cuda:
        return per_sample_sdpa(query, key, value, offsets, scaling, window), None
    q, k, v = (flat_tokens(t) for t in (query, key, value))
    value_dim = v.shape[-1]
    if value_dim != q.shape[-1]:  # MLA (DeepSeek): values narrower than queries; the flash kernel wants one width
        v = torch.nn.functional.pad(v, [0, q.shape[-1] - value_dim])
    out = gpu_varlen(q, k, v, offsets.to(device=q.device, dtype=torch.int32), int(longest), scaling, window)
    return out[..., :value_dim].reshape(batch, length, heads, value_dim), None


def whole_row_offsets(module: torch.nn.Module, position_ids: Any, batch: int, length: int,
                      device: torch.device) -> torch.Tensor:
    """Offsets that make each row one causal sequence, for a call without offsets: whole rows from outside the
    collator (DDP's gradient probe). The collator gives every batch its offsets, so positions that start again
    inside a row mean packed rows whose offsets the model did not pass on to this layer (Nemotron's decoder layer
    drops the forward's kwargs): refused rather than attended across samples."""
    if isinstance(position_ids, torch.Tensor) and bool((position_ids.diff(dim=-1) != 1).any()):
        raise RuntimeError(f"attn_implementation varlen: rows of several sequences reached {type(module).__name__} "
                           "without their sample offsets (packed rows of a model that does not pass its forward's "
                           "kwargs on to this layer, or padded prompts of a generation not run under "
                           "generation_kernel), so they would see each other; use attn_implementation: sdpa")
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


def unsupported_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float,
                     softcap: float | None) -> str | None:
    """What this kernel does not compute (the launch checks refuse these models; this guards other callers)."""
    if query.shape[2] != key.shape[2]:
        return ("queries and keys differ in length (a KV cache: generation), which takes a mask; generate under "
                "sdpa (model/varlen.py generation_kernel)")
    if dropout:
        return "attention dropout is not computed by the varlen kernel; set the model's attention_dropout to 0"
    if softcap:
        return "attention logit softcapping is not computed by the varlen kernel; use attn_implementation: eager"
    if not getattr(module, "is_causal", True):
        return f"{type(module).__name__} attends both ways, and the varlen kernel here is causal"
    return None


def compute_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast the projections are bf16 but RoPE multiplies them by fp32 tables, so queries and keys arrive
    in fp32; SDPA would be cast by autocast, a custom kernel is not. Cast as autocast would (as transformers does
    before its flash kernels)."""
    device = tensors[0].device.type
    if tensors[0].dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def flat_tokens(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D]`` -> ``[B * L, H, D]``: the rows laid end to end, as the offsets count them."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def gpu_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, longest: int,
               scaling: float | None, window: int | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    q, k, v, options = kernel_arguments(varlen_attn_keywords(), q, k, v, scaling, window)
    out = varlen_attn(q, k, v, offsets, offsets, longest, longest, **options)
    assert isinstance(out, torch.Tensor)
    return out


def kernel_arguments(takes: frozenset[str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scaling: float | None, window: int | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """q, k, v and the keywords for a varlen_attn that takes the keywords ``takes``: what an older one lacks is
    done on the inputs instead (a scale folded into the queries, the key-value heads repeated)."""
    options: dict[str, Any] = {}
    if "window_size" in takes:
        # (left, right) keys around each query; (-1, 0) is plain causal. transformers' window W lets a query see
        # itself and the W - 1 keys before it.
        options["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    elif window is None:
        options["is_causal"] = True  # torch 2.10: causal by flag, no windows
    else:
        raise RuntimeError(f"attn_implementation varlen: this torch ({torch.__version__}) has no sliding windows in "
                           "varlen_attn (torch 2.11 has); use attn_implementation: sdpa")
    if scaling is not None and "scale" in takes:
        options["scale"] = scaling
    elif scaling is not None:  # the kernel's own scale is 1/sqrt(D): fold the model's into the queries
        q = q * (scaling * q.shape[-1] ** 0.5)
    if q.shape[1] != k.shape[1] and "enable_gqa" in takes:
        options["enable_gqa"] = True
    elif q.shape[1] != k.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return q, k, v, options


def per_sample_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor,
                    scaling: float | None, window: int | None) -> torch.Tensor:
    """The CPU path: SDPA's causal kernel on each sample, read in place from ``[B, H, L, D]`` (no sample crosses a
    row: the offsets count whole rows, a row's padding its last sample); returns ``[B, L, H, D_v]``."""
    batch, heads, length, _ = query.shape
    out = query.new_empty(batch, heads, length, value.shape[-1])
    bounds = offsets.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        row, first = divmod(start, length)
        last = end - row * length
        # [1, H, n, D] views, no copies; 4-D, so that SDPA takes its CPU flash kernel (with 3-D inputs it takes the
        # math one, which keeps every sample's [H, n, n] probabilities for the backward)
        qs, ks, vs = (t[row:row + 1, :, first:last] for t in (query, key, value))
        mask = window_mask(last - first, window, query.device)
        out[row:row + 1, :, first:last] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=qs.shape[1] != ks.shape[1])
    return out.transpose(1, 2).contiguous()  # as transformers returns it: some models .view() it


def window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """The causal sliding-window mask of one sample (True: may attend); None where the window covers it all."""
    if window is None or length <= window:
        return None
    return torch.ones(length, length, dtype=torch.bool, device=device).tril().triu(-(window - 1))


@contextlib.contextmanager
def generation_kernel(model: Any) -> Iterator[None]:
    """Generation needs a padding mask and a KV cache, which the varlen kernel does not take: a model trained
    under ``varlen`` generates under sdpa (the same weights and arithmetic) and goes back afterwards."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if getattr(config, "_attn_implementation", None) != VARLEN:
        yield
        return
    base.set_attn_implementation("sdpa" if getattr(base, "_supports_sdpa", False) else "eager")
    try:
        yield
    finally:
        base.set_attn_implementation(VARLEN)
