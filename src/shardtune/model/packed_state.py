"""Packed rows through layers that carry a state along the sequence: each sample's state starts fresh.

A packed row holds several samples. Attention keeps them apart with the block mask (or the varlen offsets); a
layer with a recurrent state (gated delta net, Mamba/Mamba-2, lightning attention, RG-LRU, RWKV) or a short causal
convolution has no mask to stop it, so one sample's state would flow into the next. The fused kernels take the
boundaries (``cu_seqlens``, ``seq_idx``), but the torch paths transformers falls back to without them (every CPU,
and a GPU without fla / causal-conv1d / mamba-ssm) do not: ``torch_chunk_gated_delta_rule`` swallows
``cu_seqlens`` in ``**kwargs``, the Mamba mixers' ``torch_forward`` takes no ``seq_idx``. So each such layer runs
once per sample: the row is cut at the boundaries, the layer runs on each piece from a zero state, and the pieces
are joined again. That is each sample's own computation, whichever kernel the layer picks.

The boundaries are where the collator's ``position_ids`` start again (data/packing.py: each sample counts from 0,
and so does padding). A forward pre-hook on the model reads them at every forward and the wrapped layers read them
from there, also when activation checkpointing runs a layer again in the backward (the forward of the next
micro-batch comes only after this one's backward).

Which layers: the children of a decoder layer (the classes in ``_no_split_modules``, or ``*DecoderLayer``) that
hold a depthwise ``Conv1d`` (the short convolution every Mamba, gated-delta-net and short-conv block has), a token
shift (RWKV's ``ZeroPad2d``) or a lightning attention (MiniMax); the outermost of them, so that a block and its
recurrence run together. A model whose config names such layers but in which none is found is refused, never
trained leaking (``apply_sample_boundaries``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from shardtune.errors import ModelError

Segments = tuple[tuple[tuple[int, int], ...], ...]  # per row: (start, end) of each sample
# Stateful blocks that hold no depthwise convolution or token shift, by class name (MiniMax's linear attention).
STATEFUL_CLASS_MARKERS = ("LightningAttention",)
CACHE_KWARGS = ("cache_params", "past_key_values", "past_key_value", "state", "cache")


@dataclass
class SampleBoundaries:
    """The current forward's sample boundaries, shared by the model's hook and its wrapped layers."""

    segments: Segments | None = None
    shape: tuple[int, int] = (0, 0)  # (rows, tokens per row) of the forward these segments belong to
    running: bool = False  # inside a per-sample call: a nested wrapped layer runs as given
    wrapped: list[str] = field(default_factory=list)

    def record(self, position_ids: Any) -> None:
        self.segments, self.shape = None, (0, 0)
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() >= 2:
            rows = position_ids[0] if position_ids.dim() == 3 else position_ids  # multimodal RoPE: [3, B, L]
            self.segments, self.shape = sample_segments(rows), (rows.shape[0], rows.shape[1])


def sample_segments(position_ids: torch.Tensor) -> Segments:
    """``(start, end)`` of every sample of each row: a sample starts where the positions do not go on by one."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    length = position_ids.shape[1]
    found = []
    for row in starts.tolist():
        firsts = [i for i, start in enumerate(row) if start]
        found.append(tuple(zip(firsts, [*firsts[1:], length], strict=True)))
    return tuple(found)


def is_stateful_block(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a short causal convolution, a token shift or a lightning attention."""
    for inner in module.modules():
        if isinstance(inner, torch.nn.Conv1d) and inner.groups == inner.in_channels and inner.groups > 1:
            return True
        if isinstance(inner, torch.nn.ZeroPad2d) or type(inner).__name__.endswith(STATEFUL_CLASS_MARKERS):
            return True
    return False


def stateful_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost stateful children of the model's decoder layers, with their names."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for inner in model.modules():
        layer_classes.update(getattr(inner, "_no_split_modules", None) or [])
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == kept or name.startswith(kept + ".") for kept, _ in found):
            continue  # inside a block already taken: the outer one runs per sample as a whole
        layer = type(module).__name__
        if not (layer in layer_classes or layer.endswith("DecoderLayer")):
            continue
        for child_name, child in module.named_children():
            if is_stateful_block(child):
                found.append((f"{name}.{child_name}" if name else child_name, child))
    return found


def apply_sample_boundaries(model: torch.nn.Module, stateful_kinds: list[str]) -> SampleBoundaries:
    """Make every stateful block of ``model`` run once per packed sample (idempotent). ``stateful_kinds``: the
    kinds the model's config names (model/attention.py ``stateful_layer_kinds``); a model with such kinds but no
    block found is refused (ModelError) rather than trained with samples leaking into each other."""
    existing = getattr(model, "_shardtune_sample_boundaries", None)
    if isinstance(existing, SampleBoundaries):
        return existing
    boundaries = SampleBoundaries()
    blocks = stateful_blocks(model)
    if stateful_kinds and not blocks:
        raise ModelError(f"packing: {type(model).__name__} has {', '.join(stateful_kinds)} layers, but shardtune "
                         "found no block of them to run once per packed sample, so packed samples would leak into "
                         "each other; set packing: false (and padding_free: false)")
    for name, block in blocks:
        first = next(iter(inspect.signature(block.forward).parameters), None)
        block.forward = PerSampleForward(block.forward, boundaries)  # type: ignore[method-assign]
        if first is not None:
            block.register_forward_pre_hook(partial(_first_input_by_position, name=first), with_kwargs=True)
        boundaries.wrapped.append(name)
    model.register_forward_pre_hook(lambda _, args, kwargs: boundaries.record(kwargs.get("position_ids")),
                                    with_kwargs=True)
    model._shardtune_sample_boundaries = boundaries  # type: ignore[assignment]
    return boundaries


def runs_per_sample(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward runs once per packed sample (its submodules are called as many times as the
    rows hold samples: ZeRO-3 gathers it whole, model/length_dependent.py)."""
    return isinstance(vars(module).get("forward"), PerSampleForward)


def _first_input_by_position(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                             name: str) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The block's first input (``hidden_states``) by position, and carrying a gradient while the block trains.

    ZeRO-3 releases a module's gathered weights once the gradients of its positional inputs are computed; with no
    such input its backward hook fires as the block's backward starts, and the segments' backward then reads
    released weights (Qwen3-Next calls ``linear_attn`` with keywords alone; Kimi-Linear's first block under LoRA
    gets the frozen embeddings). A detached copy that requires a gradient changes no value and no weight's
    gradient."""
    rest = dict(kwargs)
    if not args and name not in rest:
        return None
    first, others = (args[0], args[1:]) if args else (rest.pop(name), ())
    if (isinstance(first, torch.Tensor) and first.is_floating_point() and not first.requires_grad
            and torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())):
        first = first.detach().requires_grad_()
    return (first, *others), rest


class PerSampleForward:
    """A block's forward run on each sample of each row from a fresh state, the outputs joined back."""

    def __init__(self, forward: Callable[..., Any], boundaries: SampleBoundaries) -> None:
        self.forward = forward
        self.boundaries = boundaries

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        segments = self.boundaries.segments
        if (segments is None or self.boundaries.running
                or any(kwargs.get(name) is not None for name in CACHE_KWARGS)):
            return self.forward(*args, **kwargs)  # unpacked rows, a nested block, or generation with a cache
        rows, length = self.boundaries.shape
        if all(len(row) == 1 for row in segments):
            # One sample per row: the block runs on the whole rows, and returns what it returns when it runs per
            # sample (a final state becomes None), so that ZeRO-3, which hooks every tensor a module returns,
            # sees the same outputs in every micro-batch: MiniMax's final state, returned only here, fired the
            # block's backward fetch twice, and its ranks stopped agreeing on DeepSpeed's module trace.
            return join_row([self.forward(*args, **kwargs)], [length])
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape[:2]) != (rows, length):
            raise RuntimeError(f"packed rows: a stateful block got inputs of shape {getattr(hidden, 'shape', None)}, "
                               f"not the model's [{rows}, {length}] rows, so it cannot be cut at their samples")
        self.boundaries.running = True
        try:
            joined = [join_row([self.forward(*cut(args, row, start, end, rows, length),
                                             **one_sample_kwargs(cut(kwargs, row, start, end, rows, length),
                                                                 end - start))
                                for start, end in spans], [end - start for start, end in spans])
                      for row, spans in enumerate(segments)]
        finally:
            self.boundaries.running = False
        return join_rows(joined)


OFFSET_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")
LONGEST_KWARGS = ("max_length_q", "max_length_k")


def one_sample_kwargs(kwargs: dict[str, Any], tokens: int) -> dict[str, Any]:
    """The row's varlen offsets (flash, varlen, and the fused gated-delta kernels read ``cu_seq_lens_q``) made those
    of the one sample the block now runs on: offsets of the whole row would describe tokens it does not hold."""
    found = dict(kwargs)
    for name in OFFSET_KWARGS:
        if isinstance(found.get(name), torch.Tensor):
            found[name] = torch.tensor([0, tokens], dtype=found[name].dtype, device=found[name].device)
    for name in LONGEST_KWARGS:
        if found.get(name) is not None:
            found[name] = tokens
    return found


def cut(value: Any, row: int, start: int, end: int, rows: int, length: int) -> Any:
    """``value`` (an argument, or a tuple / list / dict of them) for tokens ``start:end`` of row ``row``: tensors
    laid out ``[rows or 1, length, ...]`` are cut along the tokens, square masks ``[..., length, length]`` on both
    token dimensions; anything else is passed as it is."""
    if isinstance(value, (tuple, list)):
        return type(value)(cut(item, row, start, end, rows, length) for item in value)
    if isinstance(value, dict):
        return {key: cut(item, row, start, end, rows, length) for key, item in value.items()}
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] not in (rows, 1):
        return value
    picked = value[row:row + 1] if value.shape[0] == rows and rows > 1 else value
    if value.dim() == 4 and tuple(value.shape[-2:]) == (length, length):
        return picked[..., start:end, start:end]
    return picked[:, start:end] if value.shape[1] == length else value


def join_row(parts: list[Any], lengths: list[int]) -> Any:
    """One row's outputs from its samples' (``lengths`` tokens each): sequences joined along the tokens, square
    per-sample maps (attention weights) laid on the diagonal, token-major tensors ``[n, ...]`` stacked. A tensor
    with no token dimension (MiniMax returns its final linear-attention state) is a sample's own, with no meaning
    for the row: None, which the decoder layers discard (and anything that reads it fails, rather than misread)."""
    first = parts[0]
    if isinstance(first, (tuple, list)):
        return type(first)(join_row([part[i] for part in parts], lengths) for i in range(len(first)))
    if isinstance(first, dict):
        return {key: join_row([part[key] for part in parts], lengths) for key in first}
    if not isinstance(first, torch.Tensor):
        return first
    one = len(parts) == 1  # whole rows, or a row of one sample: kept as it is, not copied
    if all(p.dim() >= 2 and p.shape[1] == n for p, n in zip(parts, lengths, strict=True)):
        return first if one else torch.cat(parts, dim=1)
    if all(p.dim() >= 2 and tuple(p.shape[-2:]) == (n, n) for p, n in zip(parts, lengths, strict=True)):
        return first if one else diagonal(parts, lengths)
    if all(p.shape[0] == n for p, n in zip(parts, lengths, strict=True)):
        return first if one else torch.cat(parts, dim=0)
    return None


def diagonal(parts: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
    total = sum(lengths)
    out = parts[0].new_zeros(*parts[0].shape[:-2], total, total)
    offset = 0
    for part, n in zip(parts, lengths, strict=True):
        out[..., offset:offset + n, offset:offset + n] = part
        offset += n
    return out


def join_rows(rows: list[Any]) -> Any:
    """The batch from its rows (each joined by ``join_row``), stacked along the first dimension."""
    first = rows[0]
    if isinstance(first, (tuple, list)):
        return type(first)(join_rows([row[i] for row in rows]) for i in range(len(first)))
    if isinstance(first, dict):
        return {key: join_rows([row[key] for row in rows]) for key in first}
    return torch.cat(rows, dim=0) if isinstance(first, torch.Tensor) and len(rows) > 1 else first
