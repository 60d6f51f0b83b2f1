"""``streaming: true``: the data files are read lazily, shuffled through a buffer and tokenised on the fly.

As in LLaMA-Factory: every dataset is opened with ``load_dataset(..., streaming=True)``, normalised, mixed
(concat or interleave), shuffled with a buffer of ``buffer_size`` records, then ``val_size`` (a count) records
are taken from the head of that stream for evaluation and skipped for training. Each rank then keeps a disjoint
share (``split_dataset_by_node``: whole files when their number divides by the world size, else every
world-size-th record) and tokenises only that share with the same encode functions as the map-style path, so a
record gives the same token ids and labels either way. Packing happens within each batch of
``preprocessing_batch_size`` records (pt: texts concatenated into blocks; sft: whole samples packed by best fit).

The evaluation share is small and is read into memory: evaluation must see every sample once and give every rank
the same number of batches (sharded engines gather parameters in every forward), which the map-style sampler does.
The caller passes the rank and world size; this module never asks ``torch.distributed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

from datasets import (
    Dataset,
    Features,
    IterableDataset,
    concatenate_datasets,
    interleave_datasets,
    load_dataset,
)
from datasets.distributed import split_dataset_by_node

from shardtune.data.build import prepared_template, sft_options
from shardtune.data.checks import check_data_settings
from shardtune.data.formats import batch_converter, raise_record_problems, require_columns
from shardtune.data.loading import quiet_datasets_logging
from shardtune.data.packing import PACKED_FEATURES, pack_row, plan_rows
from shardtune.data.processing import TOKEN_FEATURES, document_end_id, encode_pt_batch, encode_sft_batch
from shardtune.data.registry import DatasetEntry, resolve_entries
from shardtune.data.settings import MIX_STRATEGIES, DataSettings, dataset_names
from shardtune.data.templates import get_template, special_token_strings
from shardtune.errors import DataError

logger = logging.getLogger(__name__)

Encode = Callable[[Mapping[str, list[Any]]], dict[str, list[Any]]]


def build_streams(tokenizer: Any, settings: DataSettings, rank: int = 0, world_size: int = 1
                  ) -> tuple[IterableDataset, Dataset | None]:
    """This rank's tokenised training stream, and the tokenised eval samples (in memory) or None.

    Rows hold ``input_ids`` and ``labels`` (plus ``position_ids`` and ``segment_ids`` for packed sft), as
    ``build_datasets`` gives. Call ``set_epoch(n)`` on the stream before pass ``n`` to reshuffle it.
    """
    problems = check_data_settings(settings)
    if problems:
        raise DataError(*problems)
    if settings.preprocessing_num_workers:
        logger.info("streaming: tokenisation runs inside the data loader (dataloader_num_workers), so "
                    "preprocessing_num_workers (%d) is not used", settings.preprocessing_num_workers)
    encode, features = stream_encoder(tokenizer, settings)
    train = load_stream_mix(dataset_names(settings), settings).shuffle(seed=settings.seed,
                                                                      buffer_size=settings.buffer_size)
    evaluation = None
    if settings.eval_dataset:
        evaluation = collect(encode_stream(load_stream_mix(list(settings.eval_dataset), settings), encode, features,
                                           settings), "eval_dataset")
    elif settings.val_size >= 1:
        held = int(settings.val_size)
        evaluation = collect(encode_stream(train.take(held), encode, features, settings), f"val_size ({held})")
        train = rest_after(train, held, settings)
    share = split_dataset_by_node(train, rank=rank, world_size=world_size)
    return encode_stream(share, encode, features, settings), evaluation


def rest_after(shuffled: IterableDataset, held: int, settings: DataSettings) -> IterableDataset:
    """The shuffled stream without its first ``held`` records, reshuffled on every pass.

    ``set_epoch`` reseeds every shuffle of a stream (datasets 5), so a plain ``skip`` would hold out other records
    on later passes and train on the evaluation samples. Reading the rest through a generator keeps the hold-out's
    shuffle at its first seed; a shuffle on top still gives every pass its own order.
    """
    rest = IterableDataset.from_generator(read_records, gen_kwargs={"stream": shuffled.skip(held)},
                                          features=shuffled.features)
    return rest.shuffle(seed=settings.seed, buffer_size=settings.buffer_size)


def read_records(stream: IterableDataset) -> Iterator[dict[str, Any]]:
    yield from stream


def load_stream_mix(names: list[str], settings: DataSettings) -> IterableDataset:
    """Open every named dataset as a normalised stream and mix them as ``mix_strategy`` says."""
    entries, problems = resolve_entries(names, settings.dataset_dir)
    if problems:
        raise DataError(*problems)
    parts = [normalize_stream(open_stream(entry, settings.max_samples), entry, settings) for entry in entries]
    if len(parts) == 1:
        return parts[0]
    stopping = MIX_STRATEGIES[settings.mix_strategy]
    if stopping is None:
        return concatenate_datasets(parts)
    return interleave_datasets(parts, probabilities=list(settings.interleave_probs) or None, seed=settings.seed,
                               stopping_strategy=stopping)


def open_stream(entry: DatasetEntry, max_samples: int | None) -> IterableDataset:
    """The raw records of one entry, read lazily; ``max_samples`` keeps the first that many."""
    try:
        with quiet_datasets_logging():
            records = load_dataset(entry.loader, data_files=[str(f) for f in entry.data_files], split="train",
                                   streaming=True)
    except Exception as err:  # datasets wraps resolution failures in several exception types
        raise DataError(f"{entry.path}: cannot be opened as a {entry.loader} stream ({err}); check the files") \
            from err
    return records.take(max_samples) if max_samples is not None else records


def normalize_stream(records: IterableDataset, entry: DatasetEntry, settings: DataSettings) -> IterableDataset:
    """The same conversion as ``formats.normalize_records``; a bad record raises when the stream reaches it."""
    columns = records.column_names
    if columns is None:
        columns = list(next(iter(records)).keys())
    require_columns(columns, entry, settings.stage)
    convert, features = batch_converter(entry, settings.stage)
    checked = partial(convert_and_check, convert=convert, entry=entry)
    kept = Features({name: kind for name, kind in features.items() if name != "_problem"})
    return records.map(checked, batched=True, with_indices=True, batch_size=settings.preprocessing_batch_size,
                       remove_columns=columns, features=kept)


def convert_and_check(batch: Mapping[str, list[Any]], indices: list[int], convert: Callable[..., dict[str, list[Any]]],
                      entry: DatasetEntry) -> dict[str, list[Any]]:
    out = convert(batch, indices)
    raise_record_problems(entry.path, [p for p in out.pop("_problem") if p])
    return out


def stream_encoder(tokenizer: Any, settings: DataSettings) -> tuple[Encode, Features]:
    """The batched function from normalised records to training rows, and the rows' features."""
    if settings.stage == "pt":
        special_token_strings(tokenizer)  # fails early, with a remedy, when there is no eos token
        encode = partial(encode_pt_batch, tokenizer=tokenizer, cutoff_len=settings.cutoff_len,
                         packing=settings.packing, end_id=document_end_id(tokenizer, get_template(settings.template)))
        return encode, TOKEN_FEATURES
    sft = partial(encode_sft_batch, tokenizer=tokenizer, template=prepared_template(tokenizer, settings),
                  options=sft_options(settings))
    if settings.packing:
        return partial(encode_packed_sft_batch, encode=sft, cutoff_len=settings.cutoff_len), PACKED_FEATURES
    return partial(encode_kept_sft_batch, encode=sft), TOKEN_FEATURES


def encode_kept_sft_batch(batch: Mapping[str, list[Any]], encode: Encode) -> dict[str, list[Any]]:
    """sft rows without the samples that keep no trainable token within cutoff_len (as ``tokenize_sft``)."""
    out = encode(batch)
    kept = [i for i, length in enumerate(out["_length"]) if length > 0]
    return {"input_ids": [out["input_ids"][i] for i in kept], "labels": [out["labels"][i] for i in kept]}


def encode_packed_sft_batch(batch: Mapping[str, list[Any]], encode: Encode, cutoff_len: int) -> dict[str, list[Any]]:
    """sft samples of one batch packed into rows of at most ``cutoff_len`` tokens (``packing.plan_rows``)."""
    samples = encode_kept_sft_batch(batch, encode)
    ids, labels = samples["input_ids"], samples["labels"]
    columns: dict[str, list[Any]] = {name: [] for name in PACKED_FEATURES}
    for row in plan_rows([len(x) for x in ids], cutoff_len):
        for name, values in pack_row([ids[i] for i in row], [labels[i] for i in row]).items():
            columns[name].append(values)
    return columns


def encode_stream(stream: IterableDataset, encode: Encode, features: Features, settings: DataSettings
                  ) -> IterableDataset:
    return stream.map(encode, batched=True, batch_size=settings.preprocessing_batch_size,
                      remove_columns=stream.column_names, features=features)


def collect(stream: IterableDataset, what: str) -> Dataset:
    """Read a (small) tokenised stream into memory."""
    rows = list(stream)
    if not rows:
        raise DataError(f"{what}: the evaluation samples hold no trainable token (empty texts, or prompts longer "
                        "than cutoff_len); check the data or raise cutoff_len")
    return Dataset.from_list(rows, features=stream.features)
