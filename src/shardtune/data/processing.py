"""Tokenisation and label masking for the sft and pt stages.

sft: each turn's prompt and response pieces are encoded separately (batched, one tokenizer call per
map batch) so the label mask is exact; prompt tokens get ``IGNORE_INDEX`` unless ``train_on_prompt``.
pt: every text gets the eos token; with packing the texts are concatenated and cut into blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from datasets import Dataset, Features, List, Value

from shardtune.data.caching import step_fingerprint
from shardtune.data.images import IMAGE_MARKER, ImageProcessor
from shardtune.data.settings import IGNORE_INDEX
from shardtune.data.templates import Template, special_token_strings
from shardtune.errors import DataError

logger = logging.getLogger(__name__)

TokenIds = list[int]
TOKEN_FEATURES = Features({"input_ids": List(Value("int32")), "labels": List(Value("int32"))})
# Bookkeeping columns added during sft encoding and removed before the dataset is returned.
SFT_FEATURES = Features({**TOKEN_FEATURES, "_length": Value("int32"), "_needed": Value("int32"),
                         "_cut": Value("bool")})


@dataclass(frozen=True)
class SftOptions:
    """How sft samples are cut and masked: ``mask_history`` trains only the last turn's answer; ``drop_excess``
    (``excess_length_strategy: drop``) drops a sample that does not fit whole instead of cutting it."""

    cutoff_len: int
    train_on_prompt: bool = False
    mask_history: bool = False
    drop_excess: bool = False


def tokenize_sft(dataset: Dataset, tokenizer: Any, template: Template, options: SftOptions,
                 num_proc: int | None = None, batch_size: int = 1000, images: ImageProcessor | None = None
                 ) -> Dataset:
    """Encode normalised chats; samples with nothing trainable within ``cutoff_len`` are dropped. With ``images``
    (the model's processor) the rows also keep the paths of the images whose tokens they hold."""
    cutoff_len = options.cutoff_len
    encode = partial(encode_sft_batch, tokenizer=tokenizer, template=template, options=options, images=images)
    features = SFT_FEATURES if images is None else Features({**SFT_FEATURES, "images": List(Value("string"))})
    encoded = dataset.map(encode, batched=True, remove_columns=dataset.column_names, features=features,
                          num_proc=num_proc, batch_size=batch_size, desc="Tokenizing",
                          new_fingerprint=step_fingerprint(dataset, "sft", encode))
    kept = encoded.filter(has_tokens, batched=True, input_columns="_length", num_proc=num_proc, desc="Truncating",
                          new_fingerprint=step_fingerprint(encoded, "drop-empty", has_tokens))
    if len(kept) == 0 and len(encoded) > 0:
        shortest = min(encoded["_needed"])
        needs = "whole" if options.drop_excess else "its trained turn's prompt plus one answer token"
        raise DataError(f"cutoff_len ({cutoff_len}) is too small: no sample keeps a trainable token; the shortest "
                        f"sample needs {shortest} tokens ({needs}); raise cutoff_len to at least {shortest}")
    report_cutoff(len(encoded), kept, cutoff_len, options.drop_excess)
    return kept.remove_columns(["_length", "_needed", "_cut"])


def report_cutoff(total: int, kept: Dataset, cutoff_len: int, drop_excess: bool) -> None:
    """One warning line with what cutoff_len did to the samples (``_cut`` marks a kept sample that was shortened);
    nothing when every sample fits. Warnings reach the run's output, so the user sees the counts."""
    dropped = total - len(kept)
    if drop_excess:
        if dropped:
            logger.warning("cutoff_len=%d: %d of %d samples dropped (excess_length_strategy: drop)", cutoff_len,
                           dropped, total)
        return
    cut = sum(kept["_cut"]) if len(kept) else 0
    if cut or dropped:
        logger.warning("cutoff_len=%d: %d of %d samples cut to fit (prompt whole, answers shortened), %d dropped "
                       "(the prompt leaves no room for an answer token)", cutoff_len, cut, total, dropped)


def sft_sample_fits(dataset: Dataset, tokenizer: Any, template: Template, options: SftOptions,
                    batch: int = 64) -> bool:
    """Whether any sample of ``dataset`` keeps a trainable token within cutoff_len, encoding batch by batch until
    one does (usually the first): the cheap way to name a dataset that cutoff_len would drop whole."""
    for start in range(0, len(dataset), batch):
        if any(encode_sft_batch(dataset[start:start + batch], tokenizer, template, options)["_length"]):
            return True
    return False


def has_tokens(lengths: list[int]) -> list[bool]:
    return [length > 0 for length in lengths]


def encode_sft_batch(batch: Mapping[str, list[Any]], tokenizer: Any, template: Template, options: SftOptions,
                     images: ImageProcessor | None = None) -> dict[str, list[Any]]:
    """Batched map function: render every sample's turns, encode all pieces at once, then assemble."""
    tools = batch.get("tools") or [""] * len(batch["_messages"])
    rendered = [template.render_turns(system, messages, tokenizer, sample_tools or "")
                for system, messages, sample_tools in zip(batch["_system"], batch["_messages"], tools, strict=True)]
    pieces = [piece for turns in rendered for turn in turns for piece in turn]
    ids = tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
    sample_images = batch.get("_images") or [[] for _ in rendered]
    if images is not None:
        ids = with_image_tokens(pieces, ids, [path for paths in sample_images for path in paths], images)
    out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "_length": [], "_needed": [], "_cut": []}
    if images is not None:
        out["images"] = []
    start = 0
    for turns, paths in zip(rendered, sample_images, strict=True):
        pairs = [(ids[start + 2 * k], ids[start + 2 * k + 1]) for k in range(len(turns))]
        start += 2 * len(turns)
        full_length = sum(len(prompt) + len(response) for prompt, response in pairs)
        input_ids, labels = assemble_within_cutoff(pairs, options, full_length)
        out["input_ids"].append(input_ids)
        out["labels"].append(labels)
        if images is not None:
            out["images"].append(kept_images(input_ids, paths, images.image_token_id, options.mask_history))
        out["_length"].append(len(input_ids))
        out["_cut"].append(full_length > options.cutoff_len)
        out["_needed"].append(full_length if options.drop_excess else needed_tokens(pairs, options.mask_history))
    return out


def assemble_within_cutoff(pairs: list[tuple[TokenIds, TokenIds]], options: SftOptions, full_length: int
                           ) -> tuple[TokenIds, TokenIds]:
    """One sample's (input_ids, labels) within cutoff_len: cut (``assemble_*``), or empty when it does not fit
    whole and ``drop_excess``."""
    if options.drop_excess and full_length > options.cutoff_len:
        return [], []
    if options.mask_history:
        return assemble_last_turn_sample(pairs, options.cutoff_len)
    return assemble_sft_sample(pairs, options.cutoff_len, options.train_on_prompt)


def needed_tokens(pairs: list[tuple[TokenIds, TokenIds]], last_turn: bool) -> int:
    """The fewest tokens that keep a sample: its trained turn's prompt plus one answer token."""
    if not pairs:
        return 0
    return len((pairs[-1] if last_turn else pairs[0])[0]) + 1


def with_image_tokens(pieces: list[str], ids: list[TokenIds], paths: list[str], images: ImageProcessor
                      ) -> list[TokenIds]:
    """``ids`` with every piece that holds ``<image>`` markers encoded again by the processor, which expands each
    marker to its image's tokens; ``paths`` are the batch's images in the order their markers appear."""
    out, taken = list(ids), 0
    for number, piece in enumerate(pieces):
        count = piece.count(IMAGE_MARKER)
        if count:
            out[number] = images.encode_piece(piece, paths[taken:taken + count])
            taken += count
    return out


def kept_images(input_ids: TokenIds, paths: list[str], image_token_id: int, last_turns: bool) -> list[str]:
    """The images whose tokens a sample kept: cutoff_len drops whole turns at the end (or, with mask_history, at
    the start), so the kept ones are the first (or last) as many images as runs of image tokens remain."""
    runs = sum(1 for k, token in enumerate(input_ids)
               if token == image_token_id and (k == 0 or input_ids[k - 1] != image_token_id))
    if runs == 0:
        return []
    return paths[-runs:] if last_turns else paths[:runs]


def assemble_sft_sample(pairs: list[tuple[TokenIds, TokenIds]], cutoff_len: int, train_on_prompt: bool
                        ) -> tuple[TokenIds, TokenIds]:
    """Concatenate (prompt, response) turns within ``cutoff_len``.

    Whole turns are kept while they fit. The first turn that does not fit keeps its full prompt and
    as much of its answer as fits (at least one token), then the sample ends: cutting a prompt would
    remove the assistant header and teach the model answers to questions it never saw whole.
    Returns empty lists when not even the first prompt plus one answer token fits.
    """
    input_ids: TokenIds = []
    labels: TokenIds = []
    for prompt, response in pairs:
        room = cutoff_len - len(input_ids) - len(prompt)
        if room < 1:
            break
        kept = response[:room]
        input_ids += prompt + kept
        labels += (prompt if train_on_prompt else [IGNORE_INDEX] * len(prompt)) + kept
        if len(kept) < len(response):
            break
    if not any(label != IGNORE_INDEX for label in labels):
        return [], []
    return input_ids, labels


def assemble_last_turn_sample(pairs: list[tuple[TokenIds, TokenIds]], cutoff_len: int) -> tuple[TokenIds, TokenIds]:
    """``mask_history``: the last turn is trained, earlier turns are context (labels IGNORE_INDEX).

    The last turn is kept first (its full prompt and as much answer as fits, at least one token), then earlier
    whole turns are put before it, newest first, while they fit - as LLaMA-Factory gives the last turns priority.
    Returns empty lists when the last prompt plus one answer token does not fit.
    """
    if not pairs:
        return [], []
    prompt, response = pairs[-1]
    room = cutoff_len - len(prompt)
    if room < 1 or not response:
        return [], []
    input_ids, labels = prompt + response[:room], [IGNORE_INDEX] * len(prompt) + response[:room]
    for prompt, response in reversed(pairs[:-1]):
        if len(input_ids) + len(prompt) + len(response) > cutoff_len:
            break
        input_ids = prompt + response + input_ids
        labels = [IGNORE_INDEX] * (len(prompt) + len(response)) + labels
    return input_ids, labels


def tokenize_pt(dataset: Dataset, tokenizer: Any, cutoff_len: int, packing: bool,
                num_proc: int | None = None, batch_size: int = 1000, end_id: int | None = None) -> Dataset:
    """Encode plain texts for pre-training; labels equal input_ids (the model shifts them). Each text ends with
    ``end_id`` (``document_end_id``; eos by default)."""
    special_token_strings(tokenizer)  # fails early, with a remedy, when there is no eos token
    encode = partial(encode_pt_batch, tokenizer=tokenizer, cutoff_len=cutoff_len, packing=packing, end_id=end_id)
    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, features=TOKEN_FEATURES,
                       num_proc=num_proc, batch_size=batch_size, desc="Tokenizing",
                       new_fingerprint=step_fingerprint(dataset, "pt", encode))


def document_end_id(tokenizer: Any, template: Template) -> int:
    """The token that ends each pre-training document: the template's ``document_end`` where the tokenizer has it
    as one token (Llama 3's ``<|end_of_text|>``), else eos."""
    token = template.document_end.replace("{eos}", special_token_strings(tokenizer)["{eos}"])
    if token not in tokenizer.get_vocab():
        return int(tokenizer.eos_token_id)
    return int(tokenizer.convert_tokens_to_ids(token))


def encode_pt_batch(batch: Mapping[str, list[Any]], tokenizer: Any, cutoff_len: int, packing: bool,
                    end_id: int | None = None) -> dict[str, list[Any]]:
    """Batched map function. With packing, blocks do not cross map batches (preprocessing_batch_size texts)."""
    texts = [text for text in batch["_text"] if text.strip()]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    end = tokenizer.eos_token_id if end_id is None else end_id
    documents = [ids + [end] for ids in encoded]
    if packing:
        stream = [token for document in documents for token in document]
        blocks = [stream[i : i + cutoff_len] for i in range(0, len(stream), cutoff_len)]
    else:
        blocks = [document[:cutoff_len] for document in documents]
    return {"input_ids": blocks, "labels": [list(block) for block in blocks]}
