"""Batching: right padding, labels, positions, and the attention mask for plain or packed rows.

How packed rows stay independent (checked against transformers 5.23: ``masking_utils.py``,
``integrations/sdpa_attention.py``, ``integrations/flex_attention.py``,
``modeling_flash_attention_utils.py`` and ``models/llama/modeling_llama.py``):

* ``create_causal_mask`` returns a 4-D ``attention_mask`` unchanged ("already prepared") and the
  attention function receives it as is. So for packed rows we build the block-diagonal causal
  mask ourselves, shape ``[B, 1, L, L]``:
  - ``sdpa``: boolean, True = may attend (the convention of transformers' own ``sdpa_mask``); it
    goes straight into ``torch.nn.functional.scaled_dot_product_attention``.
  - ``eager`` and ``flex_attention``: additive float32, 0 where allowed and the float32 minimum
    where blocked, because both add the mask to the scores (``scores + attention_mask``); a
    boolean mask would silently add 0/1 and block nothing.
  - unknown (``attn_implementation=None``): the additive float32 mask, which SDPA also accepts
    for any query dtype, so a collator built without the setting is slower at worst, never wrong.
* ``flash_attention_*`` and shardtune's ``varlen`` (torch's varlen kernel: model/varlen.py) take no dense mask.
  Under ``varlen`` every batch carries the offsets, unpacked rows too (a row, then its padding): a layer that
  gets none can then tell that its model dropped them. transformers only infers packed boundaries from
  ``position_ids`` when the batch is a single row, so we pass the varlen kwargs explicitly:
  ``cu_seq_lens_q/k`` (int32 offsets over the flattened ``B * L`` tokens) and ``max_length_q/k``
  (Python ints, as transformers' ``DataCollatorWithFlattening`` does), and no ``attention_mask``.
  (Relying on ``position_ids`` alone is not enough for sdpa/eager either: that detection is skipped
  whenever a KV cache exists, and the model creates one unless ``use_cache=False``.)
* Sliding-window layers: a 4-D mask is used as is, so the window must be in it. ``window_by_layer_type``
  (from the model's config: ``model.attention.layer_windows``) names each kind of layer and its window; with one
  kind the mask is a tensor (windowed for Mistral-style models, whose mask function returns a 4-D mask
  unchanged), with several (Gemma 2/3, GPT-OSS: local and global layers) it is ``{layer type: mask}``, which
  those models take in place of building their own. Flash gets each layer's window from the layer itself.
* Rows that are not packed get the usual 2-D padding mask ``[B, L]`` (1 = token, 0 = padding), and no mask at
  all when no row is padded: transformers checks a given mask on every forward (a host sync on a GPU) to find it
  all ones and take the plain causal kernel, which is what no mask gives directly.
* ``unmasked_padding`` (torch_compile on full-attention rows: train/setup.py): padded rows get no mask either,
  and their padding's positions go on from the row's last token. Padding is at the right, so under causal
  attention no real token attends to it; only the padding's own outputs change, and its labels are ignored. The
  compiled layers then see no mask in every step instead of a mask in some (each kind is a graph of its own).
  The positions go on so that transformers does not read the padding as a packed sequence and build a mask.

Padding forms its own causal segment so that no query row is fully masked (an all-blocked row
makes SDPA return NaN, which would then leak into real tokens through 0 * NaN).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardtune.data.settings import IGNORE_INDEX, VARLEN, takes_offsets


class DataCollator:
    """Pads a list of tokenised samples into tensors.

    Features hold ``input_ids`` and ``labels``; packed rows also ``position_ids`` and ``segment_ids``.
    Returns tensors ``input_ids``, ``labels`` (IGNORE_INDEX on padding), ``position_ids`` and
    ``attention_mask`` (see the module docstring for its shape per attention implementation);
    packed rows under flash attention get the varlen kwargs instead of ``attention_mask``, two of
    which are Python ints, so move only tensor values to the device. ``window_by_layer_type``: the model's kinds
    of attention layers and their sliding windows (None: no window); full attention everywhere when not given.
    ``row_tokens``: with ``padding_free``, the most tokens a row holds (default: the micro-batch's longest sample).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None,
                 attn_implementation: str | None = None,
                 window_by_layer_type: Mapping[str, int | None] | None = None, padding_free: bool = False,
                 sequence_parallel: int = 1, row_tokens: int | None = None, unmasked_padding: bool = False,
                 recurrent_kinds: frozenset[str] = frozenset()) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.attn_implementation = attn_implementation
        self.window_by_layer_type = dict(window_by_layer_type or {"full_attention": None})
        self.padding_free = padding_free
        # micro_batch_tokens: padding-free rows hold up to the budget, so a token-budget micro-batch is one row (as
        # LLaMA-Factory v1's dynamic_padding_free); otherwise a row holds as much as the longest sample.
        self.row_tokens = row_tokens
        # Sequence parallelism: rows padded to a multiple of the group size, and the segment ids handed over in place
        # of a mask (each rank builds the whole row's mask itself: train/sequence_shards.py).
        self.sequence_parallel = sequence_parallel
        self.unmasked_padding = unmasked_padding  # see the module docstring
        # Layer kinds with a recurrent state or a short convolution (model/packed_state.py): they run once per sample
        # and read a mask only as a 2-D padding mask, so they get none (transformers gives them none for a 4-D mask).
        self.recurrent_kinds = recurrent_kinds

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if self.padding_free and not any("segment_ids" in f for f in features):
            longest = max(len(f["input_ids"]) for f in features)
            features = rows_without_padding(features, self.padded_length(max(longest, self.row_tokens or 0)))
        length = self.padded_length(max(len(f["input_ids"]) for f in features))
        batch: dict[str, Any] = {
            "input_ids": pad_rows([f["input_ids"] for f in features], length, self.pad_token_id),
            "labels": pad_rows([f["labels"] for f in features], length, IGNORE_INDEX),
            # Padding restarts its positions at 0 so it reads as one more sequence, never as a
            # continuation of the last sample, for kernels that read boundaries from positions (unmasked padding
            # goes on from the row instead: see the module docstring).
            "position_ids": torch.stack([padded_positions(f, length, self.unmasked_padding) for f in features]),
        }
        segments = torch.stack([padded_segments(f, length) for f in features])
        # Real (non-padding) tokens, for throughput: packed rows carry no 2-D mask to count them from.
        batch["num_tokens"] = (segments > 0).sum()
        packed = any("segment_ids" in f for f in features)
        if self.sequence_parallel > 1:
            batch["segment_ids"] = segments
        elif self.attn_implementation == VARLEN or (packed and takes_offsets(self.attn_implementation)):
            batch.update(flash_varlen_kwargs(segments))
        elif not packed:
            if not (self.unmasked_padding or bool((segments > 0).all())):  # see the module docstring
                batch["attention_mask"] = (segments > 0).long()
        else:
            batch["attention_mask"] = self.packed_masks(segments)
        return batch

    def packed_masks(self, segments: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor | None] | None:
        as_bool = self.attn_implementation == "sdpa"
        masks = {kind: None if kind in self.recurrent_kinds else block_causal_mask(segments, as_bool, window)
                 for kind, window in self.window_by_layer_type.items()}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def padded_length(self, longest: int) -> int:
        """``longest`` rounded up so that each rank's slice of the row (the whole row without a split) is a multiple of
        ``pad_to_multiple_of``: a rank computes its slice alone (fp8's matmuls need 16-aligned token counts there), so
        the row is a multiple of N times it, not of lcm(multiple, N)."""
        multiple = (self.pad_to_multiple_of or 1) * self.sequence_parallel
        return -(-longest // multiple) * multiple


class PairCollator:
    """One batch per micro-batch of pairs: the chosen rows, then the rejected rows in the same order, padded
    together (one forward scores both); ``pairs`` is the number of pairs. KTO batches carry the KL rows after the
    answer rows, and ``kto_tag``. Features with ``ref_logps`` (the reference's log-probabilities of both rows of
    each pair, precomputed) carry them as a ``[pairs, 2]`` tensor."""

    def __init__(self, collator: DataCollator | Any) -> None:  # Any: data/images.py's VisionCollator around one
        self.collator = collator

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if "kto_tag" in features[0]:
            rows = [{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features]
            rows += [{"input_ids": f["kl_input_ids"], "labels": f["kl_labels"]} for f in features]
            batch = self.collator(rows)
            batch["kto_tag"] = torch.tensor([bool(f["kto_tag"]) for f in features])
        else:  # both rows of a pair hold its prompt, and so its images (data/images.py reads "images")
            rows = [{"input_ids": f[f"{side}_input_ids"], "labels": f[f"{side}_labels"],
                     **({"images": f["images"]} if "images" in f else {})}
                    for side in ("chosen", "rejected") for f in features]
            batch = self.collator(rows)
        if "ref_logps" in features[0]:  # precomputed reference log-probabilities: [pairs, 2]
            batch["ref_logps"] = torch.tensor([f["ref_logps"] for f in features], dtype=torch.float32)
        batch["pairs"] = len(features)
        return batch


def rows_without_padding(features: Sequence[dict[str, Any]], capacity: int) -> Sequence[dict[str, Any]]:
    """``padding_free``: the micro-batch's samples in as few rows of at most ``capacity`` tokens as hold them
    (first fit, longest first), each row a packed row; the features unchanged when that saves no row.

    Every sample keeps its tokens, its positions from 0 and its labels, less its first label, which no position
    of the sample predicts anyway (the loss scores position i on label i + 1); so the block-diagonal mask of packed
    rows makes every sample's loss and gradients what they are in a padded row, with less padding computed.
    """
    order = sorted(range(len(features)), key=lambda i: -len(features[i]["input_ids"]))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        size = len(features[i]["input_ids"])
        fits = next((r for r, free in enumerate(room) if size <= free), None)
        if fits is None:
            rows.append([i])
            room.append(capacity - size)
        else:
            rows[fits].append(i)
            room[fits] -= size
    if len(rows) == len(features):
        return features
    return [packed_row([features[i] for i in members]) for members in rows]


def packed_row(samples: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
    for number, sample in enumerate(samples, start=1):
        ids, labels = list(sample["input_ids"]), list(sample["labels"])
        row["input_ids"] += ids
        row["labels"] += [IGNORE_INDEX] + labels[1:]
        row["position_ids"] += list(range(len(ids)))
        row["segment_ids"] += [number] * len(ids)
    return row


def pad_rows(rows: Sequence[Sequence[int]], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def padded_positions(feature: dict[str, Any], length: int, continued: bool = False) -> torch.Tensor:
    """The row's positions, then the padding's: from 0 (its own sequence), or ``continued`` from the row's length
    (unmasked padding of an unpacked row)."""
    size = len(feature["input_ids"])
    given = feature.get("position_ids")
    if given is None and continued:
        return torch.arange(length)
    positions = torch.as_tensor(given, dtype=torch.long) if given is not None else torch.arange(size)
    return torch.cat([positions, torch.arange(length - size)])


def padded_segments(feature: dict[str, Any], length: int) -> torch.Tensor:
    """Segment id per token: 1.. for samples, 0 for padding."""
    size = len(feature["input_ids"])
    given = feature.get("segment_ids")
    segments = torch.as_tensor(given, dtype=torch.long) if given is not None else torch.ones(size, dtype=torch.long)
    return torch.cat([segments, torch.zeros(length - size, dtype=torch.long)])


def block_causal_mask(segments: torch.Tensor, as_bool: bool, window: int | None = None) -> torch.Tensor:
    """``[B, 1, L, L]`` mask letting each token see earlier tokens of its own segment only.

    ``as_bool``: True = attend (for SDPA); otherwise additive float32, 0 or the float32 minimum. ``window``: also
    only the last ``window`` tokens, the query's own included (transformers' ``sliding_window_overlay``).
    """
    length = segments.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if window is not None:
        causal &= torch.ones(length, length, dtype=torch.bool).triu(-(window - 1))
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal
    allowed = allowed[:, None, :, :]
    if as_bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)


def flash_varlen_kwargs(segments: torch.Tensor) -> dict[str, Any]:
    """Sequence offsets for flash-attn's varlen kernel over the flattened batch (padding included)."""
    lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in segments])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    longest = int(lengths.max())
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest}
