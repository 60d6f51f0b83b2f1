"""Sequence parallelism: N consecutive ranks (a *sequence group*) share each sequence, every rank computing N-th of
its tokens through every layer; only attention needs the other ranks' tokens.

How the split stays exact (the data side is train/sequence_shards.py):

* Each rank gets its slice of the input ids, of the row's *global* position ids (so RoPE sees the true positions,
  restarting per packed sample) and of the labels shifted *before* slicing (the last token of a slice is scored on
  the first token of the next). The row's segments (each packed sample, and the padding) stay whole on every rank,
  as [start, end) spans: what each query may see is decided from them, never from the slice alone.
* Attention runs through a function registered in transformers' ``AttentionInterface`` under ``ATTENTION_NAME``;
  the model's own mask builders skip unknown implementations (transformers 5.23 ``masking_utils``: no mask is
  built), and this function attends each query to the earlier tokens of its own segment (from the whole row's
  segment spans and global indices; plus the layer's sliding window) with transformers' ``sdpa_attention_forward``,
  one call per segment with sdpa's causal flag, so no [tokens, tokens] mask is built (a mask only where a sliding
  window is shorter than the segment; a segment begun on an earlier slice gets stand-in queries instead):
  - ``ulysses``: an all-to-all turns [heads, local tokens] into [heads / N, all tokens]; attention runs over the
    whole row for N-th of the heads; a second all-to-all turns the output back. Needs heads and KV heads divisible
    by N. Two exchanges of one layer's q, k, v and output per layer.
  - ``allgather``: every rank gathers K and V of the whole row and attends its own queries to them (any head
    count); the backward sums each rank's K/V gradients back to their owner (a reduce-scatter, built from an
    all-to-all so it runs on gloo too).
* Every engine sees all ranks as data parallel: it sums (after its averaging is undone by the loop's
  ``loss_scale_for_mean_reduction``) the gradients of all ranks, which for the ranks of one sequence group are the
  parts of one sequence's gradient; the loss is normalised by the trainable tokens of all ranks, each counted once.
* The preference stages and reward models need numbers of whole rows (a row's log-probability, the score at its
  last token): each rank computes its slice's share and ``sum_over_group`` adds them up, the same on every rank of
  the group (train/preference_step.py, train/reward.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from shardtune.errors import ConfigError, ModelError
from shardtune.world import WorldLayout

ATTENTION_NAME = "shardtune_sequence_parallel"


@dataclass
class SequenceParallel:
    """This rank's sequence group: ``size`` ranks, this one holding slice ``index`` of every row."""

    size: int
    index: int
    group: Any  # the ProcessGroup of the sequence group
    mode: str = "auto"  # as asked for until a model is attached, then the mode every attached model runs
    requested: str = ""  # the mode asked for (``mode`` when not given)

    def __post_init__(self) -> None:
        self.requested = self.requested or self.mode

    def attach(self, model: torch.nn.Module) -> str:
        """Route the model's attention through the split (after the engine's setup forwards, which run whole rows);
        returns the mode used (auto resolved from the model's head counts). A second model (a preference run's
        frozen reference) shares the mode: where auto resolves differently for the two, allgather runs both."""
        from transformers import AttentionInterface, PreTrainedModel

        found = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
        if found is None:
            raise ModelError("sequence_parallel_size: the model is not a transformers model; sequence parallelism "
                             "works through transformers' attention interface")
        mode = resolve_mode(self.requested, found.config.get_text_config(), self.size)
        self.mode = mode if self.mode in (self.requested, mode) else "allgather"
        AttentionInterface.register(ATTENTION_NAME, split_attention)
        found.set_attn_implementation(ATTENTION_NAME)
        return self.mode

    def sum_over_group(self, partial: torch.Tensor) -> torch.Tensor:
        """Per-row quantities a whole row is needed for (a preference row's log-probability, a reward model's score):
        each rank's ``partial`` from its slice, summed over the sequence group, the same on every rank of it.

        The backward hands each rank's partial the upstream gradient unchanged, not summed: every rank of the group
        computes the same loss from the sum, and the engines sum the ranks' parameter gradients, so each slice's share
        of the gradient is counted once (an all-reduced backward would count it N times)."""
        return _SumOverGroup.apply(partial, self.group)

    @contextlib.contextmanager
    def scope(self, spans: list[list[tuple[int, int]]]) -> Iterator[None]:
        """One micro-batch's forward and backward (activation checkpointing recomputes in the backward): per row, the
        [start, end) of each segment of the whole row (train/sequence_shards.py), which every attention call reads."""
        previous = _ACTIVE.get("batch")
        _ACTIVE["batch"] = _Batch(self, spans)
        try:
            yield
        finally:
            _ACTIVE["batch"] = previous


@dataclass(frozen=True)
class _Batch:
    split: SequenceParallel
    spans: list[list[tuple[int, int]]]  # per row, [start, end) of each segment, in global token indices


# The micro-batch being computed; set by SequenceParallel.scope (one per process: ranks are processes).
_ACTIVE: dict[str, _Batch | None] = {"batch": None}


def join_sequence_groups(layout: WorldLayout, rank: int, mode: str) -> SequenceParallel:
    """Create every sequence group's process group (a collective: every rank creates all of them, in one order)
    and return this rank's."""
    problems = layout.sequence_parallel_problems()
    if problems:
        raise ConfigError(problems[0])
    mine: Any = None
    for ranks in layout.sequence_groups():
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    members = layout.sequence_group_of(rank)
    return SequenceParallel(layout.sequence_parallel, members.index(rank), mine, mode)


def resolve_mode(mode: str, config: Any, size: int) -> str:
    """The mode to run (the launching host's rule: engines/sequence_parallel_plan.py ``resolved_mode``), from the
    loaded model's text config; a forced ulysses whose heads do not divide is refused (check refuses it before
    launch; this is the rank's own guard)."""
    from shardtune.engines.sequence_parallel_plan import head_counts, resolved_mode

    fields = config.to_dict()
    resolved = resolved_mode(mode, fields, size)
    counts = head_counts(fields)
    if counts is None:
        raise ModelError("sequence parallelism: the model's config names no num_attention_heads; "
                         "set sequence_parallel_size: 1")
    if resolved == "ulysses" and any(count % size for count in counts):
        raise ConfigError(f"sequence_parallel_mode (ulysses): the model's {counts[0]} attention heads and {counts[1]} "
                          f"KV heads must divide by sequence_parallel_size ({size}); use allgather or auto")
    return resolved


# Kept out of torch_compile's graphs (model/compile.py compiles each decoder layer, this included): its Python loop
# runs over the micro-batch's segment spans, on which a traced graph would be guarded, so every new packed layout
# compiled the layers again (torch._dynamo's recompiles log: ``len(_ACTIVE['batch'].spans[0]) == 4``) until the
# recompile limit left them uncompiled. The projections and the MLP around it still compile, once.
@torch.compiler.disable
def split_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                    sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` [rows, heads, local tokens, head dim], ``key``/``value`` with
    the KV heads; returns [rows, local tokens, heads, head dim]. ``attention_mask`` is ignored: which tokens a query
    sees comes from the segment spans of the micro-batch in scope."""
    batch = _ACTIVE["batch"]
    if batch is None:
        raise ModelError("sequence parallelism: attention ran outside a split micro-batch (generation and other "
                         "whole-row forwards are not split); set sequence_parallel_size: 1 for them")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ModelError(f"sequence parallelism: this model's attention uses {name}, which the split attention "
                             "(sdpa) does not compute; set sequence_parallel_size: 1")
    split, local = batch.split, query.shape[2]
    if split.mode == "ulysses":
        q, k, v = (heads_to_sequence(t, split.group, split.size) for t in (query, key, value))
        out = segment_attention(module, q, k, v, batch.spans, 0, dropout, scaling, sliding_window)
        return sequence_to_heads(out, split.group, split.size), None
    k, v = (gather_sequence(t, split.group, split.size) for t in (key, value))
    first = split.index * local
    return segment_attention(module, query, k, v, batch.spans, first, dropout, scaling, sliding_window), None


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      spans: list[list[tuple[int, int]]], first_query: int, dropout: float, scaling: float | None,
                      window: int | None) -> torch.Tensor:
    """Causal attention of the queries at global indices ``first_query``.. (``query`` [rows, heads, queries, dim])
    over the whole row's ``key``/``value``, each query seeing the earlier tokens of its own segment only: one sdpa
    call per segment, so no [queries, length] mask exists (a flash-varlen kernel does the same on a GPU).
    Returns [rows, queries, heads, dim]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    queries = query.shape[2]
    last_query = first_query + queries
    rows = []
    for row, row_spans in enumerate(spans):
        parts = []
        for start, end in row_spans:
            q_start, q_end = max(start, first_query), min(end, last_query)
            if q_start >= q_end:
                continue  # no query of this slice in the segment
            # Keys: the segment's tokens up to the last query; the queries are the last q_end - q_start of them.
            q = query[row:row + 1, :, q_start - first_query:q_end - first_query]
            k, v = key[row:row + 1, :, start:q_end], value[row:row + 1, :, start:q_end]
            lead = q_start - start  # the segment's tokens on earlier slices (allgather)
            if lead and (window is None or window >= k.shape[2]):
                # Stand-in queries for those tokens, computed and dropped, so that sdpa's causal flag (aligned at
                # the top left) fits without a mask: a [queries, keys] mask and SDPA's floating copy of it would be
                # kept per layer; the stand-ins cost compute and a [tokens, heads, dim] output only.
                q = torch.cat([q.new_zeros(q.shape[0], q.shape[1], lead, q.shape[3]), q], dim=2)
            mask = causal_tail_mask(q.shape[2], k.shape[2], window, query.device)
            out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling,
                                            is_causal=mask is None)
            parts.append(out[:, out.shape[1] - (q_end - q_start):])
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def causal_tail_mask(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """None where sdpa's own causal flag is exact (as many queries as keys, no window reaching past them);
    otherwise a [queries, keys] boolean mask for queries that are the last ``queries`` of the ``keys`` tokens
    (causal aligned at the bottom right), within the sliding window (transformers' ``sliding_window_overlay``)."""
    if queries == keys and (window is None or window >= keys):
        return None
    q_index = torch.arange(keys - queries, keys, device=device)[:, None]
    k_index = torch.arange(keys, device=device)[None, :]
    allowed = k_index <= q_index
    if window is not None:
        allowed = allowed & (q_index - k_index < window)
    return allowed[None, None]


def heads_to_sequence(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[rows, heads, local, dim] -> [rows, heads / size, size x local, dim]: rank j receives head chunk j of every
    rank's tokens (in rank order, which is token order)."""
    rows, heads, local, dim = x.shape
    send = x.reshape(rows, size, heads // size, local, dim).transpose(0, 1).contiguous()
    received = all_to_all_single(torch.empty_like(send), send, group=group)  # [size (token chunk), rows, h/size, ...]
    return received.permute(1, 2, 0, 3, 4).reshape(rows, heads // size, size * local, dim)


def sequence_to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[rows, size x local, heads / size, dim] (attention's output) -> [rows, local, heads, dim]: the inverse
    exchange, each rank getting its own tokens of every head chunk."""
    rows, length, part, dim = x.shape
    local = length // size
    send = x.reshape(rows, size, local, part, dim).transpose(0, 1).contiguous()
    received = all_to_all_single(torch.empty_like(send), send, group=group)  # [size (head chunk), rows, local, ...]
    return received.permute(1, 2, 0, 3, 4).reshape(rows, local, size * part, dim)


def gather_sequence(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[rows, heads, local, dim] -> [rows, heads, size x local, dim], every rank's tokens in rank order."""
    return _GatherSequence.apply(x, group, size)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the tokens; the backward hands each rank the sum of every rank's gradient of its tokens."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        chunks = torch.stack(grad.chunk(ctx.size, dim=2)).contiguous()  # [size, rows, heads, local, dim]
        received = torch.empty_like(chunks)
        dist.all_to_all_single(received, chunks, group=ctx.group)  # every rank's gradient of my tokens
        return received.sum(0), None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over the sequence group; the identity backward (see ``SequenceParallel.sum_over_group``)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        total = partial.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
