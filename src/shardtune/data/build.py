"""``build_datasets``: from settings and a tokenizer to tokenised train and eval datasets.

Steps: check settings -> load each entry's files (num_samples, max_samples) -> normalise records -> mix
(concat or interleave) -> tokenise (and truncate) -> eval_dataset, or hold out the eval split -> pack.
Every step raises ``DataError`` with all problems it found.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import datasets
from datasets import Dataset, concatenate_datasets, interleave_datasets

from shardtune.data.checks import check_data_settings
from shardtune.data.formats import normalize_records
from shardtune.data.images import ImageProcessor, ImageSettings, load_image_processor
from shardtune.data.loading import load_records
from shardtune.data.packing import pack_dataset
from shardtune.data.preference import (
    is_preference_stage,
    normalize_preference_records,
    preference_sample_fits,
    tokenize_preference,
)
from shardtune.data.processing import SftOptions, document_end_id, sft_sample_fits, tokenize_pt, tokenize_sft
from shardtune.data.registry import resolve_entries
from shardtune.data.settings import MIX_STRATEGIES, DataSettings, dataset_names
from shardtune.data.templates import Template, get_template, missing_special_tokens
from shardtune.errors import DataError

logger = logging.getLogger(__name__)


def build_datasets(tokenizer: Any, settings: DataSettings) -> tuple[Dataset, Dataset | None]:
    """Tokenised train dataset and the eval dataset: ``eval_dataset`` when named, else the ``val_size``
    hold-out, else None.

    sft rows hold ``input_ids`` and ``labels`` (plus ``position_ids`` and ``segment_ids`` when packed);
    pt rows hold ``input_ids`` and ``labels``. Feed batches through ``DataCollator``.
    """
    problems = check_data_settings(settings)
    if problems:
        raise DataError(*problems)
    with fresh_cache(settings.overwrite_cache):
        mixed = load_mixed(dataset_names(settings), settings, tokenizer)
        named = load_mixed(list(settings.eval_dataset), settings, tokenizer) if settings.eval_dataset else None
        images = image_processor_for([part for part in (mixed, named) if part is not None], tokenizer, settings)
        tokenized = tokenize(mixed, tokenizer, settings, images)
        named_eval = tokenize(named, tokenizer, settings, images) if named is not None else None
    if len(tokenized) == 0:
        raise DataError(f"datasets {', '.join(dataset_names(settings))} produced no samples (all texts are empty)")
    if named_eval is not None:
        train, evaluation = tokenized, named_eval
    else:
        train, evaluation = split_eval(tokenized, settings.val_size, settings.seed)
    if settings.packing and settings.stage == "sft":
        train = pack_dataset(train, settings.cutoff_len)
        evaluation = pack_dataset(evaluation, settings.cutoff_len) if evaluation is not None else None
    return train, evaluation


@contextlib.contextmanager
def fresh_cache(enabled: bool) -> Iterator[None]:
    """overwrite_cache: recompute every step instead of reading datasets' cache files."""
    if not enabled:
        yield
        return
    datasets.disable_caching()
    try:
        yield
    finally:
        datasets.enable_caching()


def load_mixed(names: list[str], settings: DataSettings, tokenizer: Any = None) -> Dataset:
    """Load every named dataset, normalise it, and mix them; problems from all files are raised together.
    With ``tokenizer``, a dataset of several whose every sample cutoff_len would cut away is named."""
    entries, problems = resolve_entries(names, settings.dataset_dir)
    parts: list[Dataset] = []
    for entry in entries:
        try:
            records = load_records(entry, settings.max_samples, settings.seed)
            normalize = normalize_preference_records if is_preference_stage(settings.stage) else normalize_records
            parts.append(normalize(records, entry, settings.stage, settings.preprocessing_num_workers,
                                   settings.preprocessing_batch_size))
        except DataError as err:
            problems += err.problems
    if not problems and tokenizer is not None and len(parts) > 1:
        problems = [f"dataset '{entry.name}': cutoff_len ({settings.cutoff_len}) is too small for every one of its "
                    f"{len(part)} samples, so it would be left out of the mix; raise cutoff_len or remove it"
                    for entry, part in zip(entries, parts, strict=True) if not fits_cutoff(part, tokenizer, settings)]
    if problems:
        raise DataError(*problems)
    return mix_datasets(parts, settings.mix_strategy, settings.interleave_probs, settings.seed)


def fits_cutoff(part: Dataset, tokenizer: Any, settings: DataSettings) -> bool:
    """Whether at least one sample of one normalised dataset keeps a trained token within cutoff_len (pt: any text
    is cut into blocks, so it always does)."""
    if settings.stage == "pt":
        return True
    template = get_template(settings.template, settings.default_system, settings.enable_thinking,
                            settings.tool_format)
    if is_preference_stage(settings.stage):
        return preference_sample_fits(part, tokenizer, template, settings.stage, settings.cutoff_len,
                                      drops_excess(settings))
    return sft_sample_fits(part, tokenizer, template, sft_options(settings))


def mix_datasets(parts: list[Dataset], strategy: str, probabilities: tuple[float, ...], seed: int) -> Dataset:
    """One dataset from several: concatenated, or interleaved by ``probabilities`` (see DataSettings)."""
    if len(parts) == 1:
        return parts[0]
    stopping = MIX_STRATEGIES[strategy]
    if stopping is None:
        return concatenate_datasets(parts)
    return interleave_datasets(parts, probabilities=list(probabilities) or None, seed=seed,
                               stopping_strategy=stopping)


def image_processor_for(parts: list[Dataset], tokenizer: Any, settings: DataSettings) -> ImageProcessor | None:
    """The model's image processor when any sample has images (None otherwise)."""
    if not any("_images" in part.column_names and any(part["_images"]) for part in parts):
        return None
    return load_image_processor(settings.model_dir, tokenizer, image_settings(settings))


def image_settings(settings: DataSettings) -> ImageSettings:
    return ImageSettings(settings.image_max_pixels, settings.image_min_pixels)


def tokenize(records: Dataset, tokenizer: Any, settings: DataSettings, images: ImageProcessor | None = None
             ) -> Dataset:
    workers, batch_size = settings.preprocessing_num_workers, settings.preprocessing_batch_size
    if settings.stage == "pt":
        return tokenize_pt(records, tokenizer, settings.cutoff_len, settings.packing, workers, batch_size,
                           document_end_id(tokenizer, get_template(settings.template)))
    if is_preference_stage(settings.stage):
        return tokenize_preference(records, tokenizer, prepared_template(tokenizer, settings), settings.stage,
                                   settings.cutoff_len, workers, batch_size, images, drops_excess(settings))
    return tokenize_sft(records, tokenizer, prepared_template(tokenizer, settings), sft_options(settings), workers,
                        batch_size, images)


def prepared_template(tokenizer: Any, settings: DataSettings) -> Template:
    """The sft template, checked against the tokenizer (a warning for special tokens it would split)."""
    template = get_template(settings.template, settings.default_system, settings.enable_thinking,
                            settings.tool_format)
    template.validate(tokenizer)
    missing = missing_special_tokens(template, tokenizer)
    if missing:
        logger.warning("template '%s' uses %s, which the tokenizer does not know; they will be split into "
                       "several ordinary tokens", template.name, ", ".join(missing))
    return template


def sft_options(settings: DataSettings) -> SftOptions:
    return SftOptions(settings.cutoff_len, settings.train_on_prompt, settings.mask_history, drops_excess(settings))


def drops_excess(settings: DataSettings) -> bool:
    """``excess_length_strategy: drop``: a sample longer than cutoff_len is dropped rather than cut."""
    return settings.excess_length_strategy == "drop"


def split_eval(dataset: Dataset, val_size: float, seed: int) -> tuple[Dataset, Dataset | None]:
    """Hold out ``val_size`` samples (a fraction below 1, else a count), shuffled with ``seed``."""
    if val_size <= 0:
        return dataset, None
    count = int(val_size) if val_size >= 1 else max(1, round(val_size * len(dataset)))
    if count >= len(dataset):
        raise DataError(f"val_size ({val_size}) holds out {count} samples but only {len(dataset)} remain after "
                        "preprocessing, leaving none for training; lower val_size")
    split = dataset.train_test_split(test_size=count, seed=seed, shuffle=True)
    return split["train"], split["test"]
