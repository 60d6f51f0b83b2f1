"""The settings the data layer needs, independent of how the config file is laid out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig

STAGES = ("sft", "pt", "dpo", "kto", "rm", "grpo")  # dpo, kto, rm: preference data (data.preference); grpo: prompts
# How several datasets become one, as LLaMA-Factory names it -> datasets' interleave stopping strategy.
MIX_STRATEGIES = {"concat": None, "interleave_under": "first_exhausted", "interleave_over": "all_exhausted",
                  "interleave_once": "all_exhausted_without_replacement"}
IGNORE_INDEX = -100  # label value that the loss skips (transformers' convention)


@dataclass(frozen=True)
class DataSettings:
    """Which datasets to load and how to turn them into token ids.

    ``dataset`` names entries of ``<dataset_dir>/dataset_info.json``; several are mixed by ``mix_strategy``:
    concatenated, or interleaved by drawing each sample from dataset i with probability ``interleave_probs[i]``
    (equal when empty) until the first dataset runs out (under), all have run out (over, the short ones
    repeat) or all have been used once (once).
    ``eval_dataset`` names the datasets evaluated on; otherwise ``val_size`` below 1 is a fraction of the
    samples held out for evaluation, 1 or more a count.
    ``packing`` puts several whole samples into one row of at most ``cutoff_len`` tokens (sft), each seeing
    only itself (what LLaMA-Factory calls ``neat_packing``), or concatenates texts into ``cutoff_len``
    blocks (pt). ``mask_history``: only the last turn's answer is trained; earlier turns are context.
    ``excess_length_strategy``: a sft or preference sample longer than ``cutoff_len`` is ``truncate``d (its prompt
    kept whole, its answers cut; dropped only when the prompt leaves no room for an answer token) or ``drop``ped.
    ``streaming`` reads the files lazily, shuffles through a buffer of ``buffer_size`` records and tokenises on
    the fly (``data.streaming``); ``val_size`` must then be a count.
    """

    dataset: tuple[str, ...]
    dataset_dir: str = "data"
    template: str = "default"
    default_system: str | None = None
    enable_thinking: bool = True
    tool_format: str | None = None
    stage: str = "sft"
    cutoff_len: int = 1024
    max_samples: int | None = None
    val_size: float = 0.0
    packing: bool = False
    train_on_prompt: bool = False
    seed: int = 42
    preprocessing_num_workers: int | None = None
    overwrite_cache: bool = False
    eval_dataset: tuple[str, ...] = ()
    mix_strategy: str = "concat"
    interleave_probs: tuple[float, ...] = ()
    mask_history: bool = False
    excess_length_strategy: str = "truncate"
    neat_packing: bool = False
    preprocessing_batch_size: int = 1000
    streaming: bool = False
    buffer_size: int = 16384
    model_dir: str = ""  # the model's folder, whose processor reads the images of samples that have them
    image_max_pixels: int = 768 * 768
    image_min_pixels: int = 32 * 32


def dataset_names(settings: DataSettings) -> list[str]:
    """The dataset names, also accepting LLaMA-Factory's comma-separated string form."""
    raw = settings.dataset
    parts = raw.split(",") if isinstance(raw, str) else list(raw)
    return [name.strip() for name in parts if name.strip()]


# shardtune's kernel for packed rows over torch's varlen flash kernel (model/varlen.py).
VARLEN = "varlen"


def takes_offsets(kernel: str | None) -> bool:
    """Attention kernels that take packed rows as sequence offsets (``cu_seq_lens``), with no dense mask."""
    return kernel is not None and (kernel.startswith("flash") or kernel == VARLEN)


def packs_sample_boundaries(c: TrainConfig) -> bool:
    """Whether rows hold several samples kept apart (packed sft rows, padding-free rows): the rows whose attention
    takes a block mask or sequence offsets. Packed pt rows are one text cut into rows, with no boundaries."""
    return (c.stage == "sft" and resolved_packing(c)) or c.padding_free is True


def packs_half_rows(c: TrainConfig) -> bool:
    """Rows with sample boundaries in bf16 or fp16: where ``auto`` takes the varlen kernel on a CUDA GPU."""
    return packs_sample_boundaries(c) and half_precision(c)


def half_precision(c: TrainConfig) -> bool:
    """Attention runs in bf16 or fp16 (autocast, or bf16 weights)."""
    return c.bf16 or c.fp16 or c.pure_bf16


def resolved_packing(c: TrainConfig) -> bool:
    """Whether a run packs samples into rows (default: on for pt, off for sft); neat_packing turns packing on:
    shardtune's sft packing always keeps samples apart."""
    if c.neat_packing:
        return True
    return c.packing if c.packing is not None else c.stage == "pt"
