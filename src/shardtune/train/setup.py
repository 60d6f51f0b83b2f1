"""Translate the config into the explicit settings each component takes, and build those components."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeGuard

import torch
from torch.utils.data import DataLoader, DistributedSampler

from shardtune.config.schema import TrainConfig
from shardtune.data.budget_batches import TokenBudgetBatches
from shardtune.engines.base import Engine
from shardtune.errors import ConfigError, ModelError
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.reward_head import RewardHead
from shardtune.model.source import ModelSource
from shardtune.model.vocab import VocabGrowth, plan_vocab_growth


def prepare_model_dir(c: TrainConfig, engine: Engine) -> None:
    """Build the tiny demo model once (main rank) when asked and missing; other ranks wait."""
    path = Path(c.model_name_or_path or "")
    if c.build_tiny_model_if_missing and not (path / "config.json").is_file() and engine.is_main:
        from shardtune.model.tiny import build_tiny_model, tiny_model_build_problem

        problem = tiny_model_build_problem(str(path))  # the launching host said so already; a caller may not have
        if problem:
            raise ModelError(problem)
        print(f"[shardtune] building the tiny demo model in {path}", flush=True)
        build_tiny_model(path)
    engine.barrier()


def with_attention_resolved(c: TrainConfig, is_main: bool) -> TrainConfig:
    """``auto`` still open here (a hub id the launching host had not cached, or a caller that skipped the launch
    checks): decide it from the loaded config, as the launching host does, and check packing under it."""
    from shardtune.data.settings import packs_half_rows
    from shardtune.model.attention import AUTO, auto_choice, kernel_support, packing_problem
    from shardtune.model.load import load_model_config
    from shardtune.train.settings import resolved_packing

    if c.attn_implementation != AUTO:
        return c
    name = c.model_name_or_path or ""
    config = load_model_config(name, trust_remote_code=c.trust_remote_code).to_dict()
    choice = auto_choice(config, has_cuda=torch.cuda.is_available(), model=name,
                         splits_sequences=c.sequence_parallel_size > 1, packed_half_rows=packs_half_rows(c))
    problem = packing_problem(config, kernel_support(config), choice.kernel, name) if resolved_packing(c) else None
    if problem:
        raise ConfigError(problem)
    if is_main:
        print(f"[shardtune] attention: {choice.kernel} ({choice.reason})", flush=True)
    return replace(c, attn_implementation=choice.kernel)


def prepare_datasets(tokenizer: Any, c: TrainConfig, engine: Engine) -> tuple[Any, Any]:
    """Tokenise once and let the other ranks read the result: (train, eval or None)."""
    from shardtune.data import build_datasets
    from shardtune.train.settings import data_settings

    if c.tokenized_path:
        return prepare_tokenized(tokenizer, c, engine)
    if c.streaming:
        from shardtune.data.streaming import build_streams

        # Nothing is cached on disk, so every rank opens its own share at once.
        return build_streams(tokenizer, data_settings(c), engine.data_parallel_rank, engine.data_parallel_size)
    # Rank 0 tokenises first and fills the datasets cache; the other ranks then read it.
    if not engine.is_main:
        engine.barrier()
    if c.stage == "grpo":  # prompts with their reward columns, no eval set (data/rl_prompts.py)
        from shardtune.data.rl_prompts import build_rl_prompts

        datasets = build_rl_prompts(tokenizer, data_settings(c), c.max_completion_length), None
    else:
        datasets = build_datasets(tokenizer, data_settings(c))
    if engine.is_main:
        engine.barrier()
    return datasets


def prepare_tokenized(tokenizer: Any, c: TrainConfig, engine: Engine) -> tuple[Any, Any]:
    """tokenized_path: rank 0 builds it when missing or stale; then, on nodes that do not share its
    filesystem (it is still missing there), the node's first rank builds a copy; then every rank loads."""
    from shardtune.data.tokenized import cache_key, load_tokenized
    from shardtune.train.settings import data_settings

    settings, path = data_settings(c), c.tokenized_path or ""
    key = cache_key(settings, tokenizer) if c.dataset else None
    if engine.is_main:
        build_tokenized(tokenizer, settings, path, key, force=c.overwrite_cache)
    engine.barrier()
    if engine.local_rank == 0 and not engine.is_main:
        build_tokenized(tokenizer, settings, path, key, force=False)
    engine.barrier()
    return load_tokenized(path, key)


def build_tokenized(tokenizer: Any, settings: Any, path: str, key: dict[str, Any] | None, force: bool) -> None:
    from shardtune.data import build_datasets
    from shardtune.data.tokenized import is_current, save_tokenized
    from shardtune.errors import DataError

    if not force and is_current(path, key):
        return
    if key is None:
        raise DataError(f"tokenized_path {path} holds no prepared datasets and no dataset is configured")
    print(f"[shardtune] tokenising into {path} (reused by later runs with the same data settings)", flush=True)
    train, evaluation = build_datasets(tokenizer, settings)
    save_tokenized(path, train, evaluation, key)


def model_source(c: TrainConfig, settings: FinetuningSettings, tokenizer_size: int | None = None,
                 pad_token_id: int | None = None, reads_images: bool = False) -> ModelSource:
    """Where the model comes from and how it is set up for training; each engine decides how to load it.

    With resize_vocab, ``tokenizer_size`` (the tokenizer with its added tokens) says how far the vocabulary grows;
    stage rm's score head pools at the last token that is not ``pad_token_id`` (the tokenizer's).
    """
    compute_dtype = torch.bfloat16 if c.bf16 else (torch.float16 if c.fp16 else torch.float32)
    from shardtune.train.settings import adapter_plan

    return ModelSource(c.model_name_or_path or "", settings, trust_remote_code=c.trust_remote_code,
                       attn_implementation=loaded_kernel(c), quantization_bit=c.quantization_bit,
                       quantization_type=c.quantization_type, double_quantization=c.double_quantization,
                       compute_dtype=compute_dtype, adapters=adapter_plan(c), rope_scaling=c.rope_scaling,
                       max_length=c.cutoff_len, vocab=vocab_growth(c, tokenizer_size), pure_bf16=c.pure_bf16,
                       reward_head=reward_head(c, pad_token_id), reads_images=reads_images,
                       mixture_of_depths=c.mixture_of_depths)


def loaded_kernel(c: TrainConfig) -> str:
    """The attention kernel the model loads with. Under sequence_parallel_size > 1 the split attention replaces the
    model's and runs sdpa per segment (engines/sequence_parallel.py), so flash_attention_2 there is sdpa's flash
    backend, FlashAttention-2 inside torch: it needs a CUDA GPU (and bf16/fp16: in fp32 sdpa takes its
    memory-efficient kernel), not the flash-attn package; the model loads with sdpa."""
    from shardtune.data.settings import half_precision
    from shardtune.engines.sequence_parallel_plan import refusal_for
    from shardtune.model.attention import varlen_device_problem

    problem = refusal_for(c, "attn_implementation") or varlen_device_problem(
        c.attn_implementation, has_cuda=torch.cuda.is_available(), half_precision=half_precision(c))
    if problem:
        raise ModelError(problem)
    if c.sequence_parallel_size == 1 or c.attn_implementation != "flash_attention_2":
        return c.attn_implementation
    from shardtune.model.attention import flash_problem

    problem = flash_problem(torch.cuda.is_available(), flash_installed=False, split_size=c.sequence_parallel_size)
    if problem:
        raise ModelError(problem)
    return "sdpa"


def reward_head(c: TrainConfig, pad_token_id: int | None) -> RewardHead | None:
    if c.stage != "rm":
        return None
    if pad_token_id is None:
        raise ConfigError("stage rm: the tokenizer has no padding token, which the score head's pooling needs; "
                          "set one in the tokenizer (or a template that adds it)")
    return RewardHead(pad_token_id, c.seed)


def vocab_growth(c: TrainConfig, tokenizer_size: int | None) -> VocabGrowth | None:
    if not c.resize_vocab or tokenizer_size is None:
        return None
    from shardtune.model.load import load_model_config

    rows = load_model_config(c.model_name_or_path or "", trust_remote_code=c.trust_remote_code).vocab_size
    return plan_vocab_growth(tokenizer_size, rows, c.seed)


def build_loader(dataset: Any, tokenizer: Any, batch_size: int, engine: Engine, c: TrainConfig,
                 shuffle: bool) -> DataLoader | None:
    """A loader over this rank's share of the data; the sampler's seed keeps ranks' orders consistent."""
    if dataset is None:
        return None
    collator = build_collator(tokenizer, c, has_images(dataset))
    if c.stage == "grpo":  # a micro-batch of completions is this many prompts' groups
        batch_size //= c.num_generations
    if is_stream(dataset):  # already this rank's share, shuffled by its buffer
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collator,
                          **loader_options(c, torch.cuda.is_available()))
    if shuffle and c.micro_batch_tokens is not None:
        batches = token_budget_batches(dataset, batch_size, engine, c, padded=not collator_padding_free(collator))
        options = {**loader_options(c, torch.cuda.is_available()), "drop_last": False}  # validated: not asked
        return DataLoader(dataset, batch_sampler=batches, collate_fn=collator, **options)
    sampler = ResumableSampler(make_sampler(dataset, batch_size, engine, c, shuffle))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collator,
                      **loader_options(c, torch.cuda.is_available()))


def token_budget_batches(dataset: Any, batch_size: int, engine: Engine, c: TrainConfig,
                         padded: bool) -> TokenBudgetBatches:
    """``micro_batch_tokens``: the micro-batches formed for the whole job from the sampler's order for the seed (as
    ``make_sampler`` orders samples), then dealt out, the same number to every rank each step."""
    from shardtune.data.budget_batches import form_budget_batches
    from shardtune.data.sampling import length_grouped_order

    lengths = sample_lengths(dataset)
    ranks = engine.data_parallel_size
    if c.group_by_length:
        order = length_grouped_order(lengths, batch_size * ranks, c.seed)
    else:  # DistributedSampler's shuffle of its first epoch
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(c.seed)).tolist()
    budget = c.micro_batch_tokens or 0
    return TokenBudgetBatches(form_budget_batches(order, lengths, budget, padded), lengths, padded, ranks=ranks,
                              rank=engine.data_parallel_rank, accumulation=c.gradient_accumulation_steps,
                              seed=c.seed)


def collator_padding_free(collator: Any) -> bool:
    """Whether the (innermost) collator puts a micro-batch's samples into rows without padding."""
    return bool(getattr(getattr(collator, "collator", collator), "padding_free", False))


def has_images(dataset: Any) -> bool:
    """Whether the tokenised rows keep image paths (data/images.py): the data has images."""
    return "images" in (getattr(dataset, "column_names", None) or ())


def build_collator(tokenizer: Any, c: TrainConfig, has_images: bool = False) -> Any:
    """The batch builder: padded (or packed) rows; preference stages put both rows of a pair in one batch; rows
    with images get their pixel inputs (data/images.py)."""
    from shardtune.data import DataCollator
    from shardtune.data.collator import PairCollator
    from shardtune.model.attention import recurrent_kinds
    from shardtune.model.fp8 import ALIGNMENT, float8_wanted
    from shardtune.train.settings import resolved_packing

    if c.stage == "grpo":
        from shardtune.data.rl_prompts import RolloutPromptCollator

        return RolloutPromptCollator()
    padding_free = padding_free_rows(c) and not has_images
    windows = model_layer_windows(c) if resolved_packing(c) or padding_free else None
    # fp8: the weight gradient's float8 matmul contracts over the micro-batch's tokens, which must then be a
    # multiple of 16 too (torch._scaled_mm); rows padded to 16 make rows x length one.
    collator = DataCollator(tokenizer.pad_token_id, pad_to_multiple_of=ALIGNMENT if float8_wanted(c) else None,
                            attn_implementation=c.attn_implementation,
                            window_by_layer_type=windows, padding_free=padding_free,
                            sequence_parallel=c.sequence_parallel_size, row_tokens=c.micro_batch_tokens,
                            unmasked_padding=not has_images and not padding_free and padding_left_unmasked(c),
                            recurrent_kinds=recurrent_kinds(windows or {}))
    if has_images:
        from shardtune.data.build import image_settings
        from shardtune.data.images import VisionCollator, load_image_processor
        from shardtune.train.settings import data_settings

        processor = load_image_processor(c.model_name_or_path or "", tokenizer, image_settings(data_settings(c)),
                                         c.trust_remote_code)
        collator = VisionCollator(collator, processor)
    if c.stage in ("dpo", "kto", "rm"):  # chosen and rejected rows (kto: answers and KL rows) in one batch
        return PairCollator(collator)
    return collator


def padding_free_rows(c: TrainConfig) -> bool:
    """``padding_free`` where it applies: unpacked sft/pt rows of a model whose packed rows stay apart under the
    kernel (the checks ``packing: true`` passes before launch) and that adds no router loss (it reads a 2-D mask).
    Preference stages keep one row per sample: their pair layout is by row. Unset (null), it is on where the block
    mask costs nothing the padding did not: on the CPU, and under kernels that take offsets (flash, varlen: no mask)."""
    from shardtune.data.settings import takes_offsets
    from shardtune.model.attention import kernel_support, packing_problem
    from shardtune.model.moe import router_aux_loss_coef

    wanted = c.padding_free if c.padding_free is not None else \
        not torch.cuda.is_available() or takes_offsets(c.attn_implementation)
    config = _unpacked_rows_model_config(c) if wanted else None
    if config is None:
        return False
    as_dict = config.to_dict()
    if router_aux_loss_coef(config, c.moe_aux_loss_coef) is not None and not takes_offsets(c.attn_implementation):
        return False
    return packing_problem(as_dict, kernel_support(as_dict), c.attn_implementation, "") is None


def padding_left_unmasked(c: TrainConfig) -> bool:
    """Whether right-padded rows go without a padding mask (data/collator.py's ``unmasked_padding``): under
    torch_compile, for unpacked sft/pt rows of a model whose every layer attends causally to the whole row (a
    sliding window brings a mask of its own on long rows), where nothing else reads the mask: no router loss (it
    leaves padding out by the mask), no mixture of depths (it ranks a row's real tokens), one rank per row."""
    from shardtune.model.attention import layer_windows
    from shardtune.model.moe import router_aux_loss_coef

    wanted = c.torch_compile and c.sequence_parallel_size == 1
    config = _unpacked_rows_model_config(c) if wanted else None
    if config is None or router_aux_loss_coef(config, c.moe_aux_loss_coef) is not None:
        return False
    return all(window is None for window in layer_windows(config).values())


def _unpacked_rows_model_config(c: TrainConfig) -> Any | None:
    """The model's config where the run's rows are unpacked sft/pt samples, one per row as the data made them
    (mixture of depths ranks a row's tokens, so it keeps that too); None otherwise."""
    from shardtune.model.load import load_model_config
    from shardtune.train.settings import resolved_packing

    if resolved_packing(c) or c.stage not in ("sft", "pt") or c.mixture_of_depths:
        return None
    return load_model_config(c.model_name_or_path or "", trust_remote_code=c.trust_remote_code)


def model_layer_windows(c: TrainConfig) -> dict[str, int | None] | None:
    """The model's kinds of attention layers and their sliding windows, for packed rows' masks."""
    from shardtune.model.attention import layer_windows
    from shardtune.model.load import load_model_config

    return layer_windows(load_model_config(c.model_name_or_path or "", trust_remote_code=c.trust_remote_code))


def loader_options(c: TrainConfig, has_cuda: bool) -> dict[str, Any]:
    """The Trainer's dataloader_* keys as DataLoader arguments, for training and eval loaders alike (as the Trainer
    does). Pinned memory only helps copies to a GPU (torch warns and skips it without one)."""
    from shardtune.startup_gc import loader_worker_collects

    return {"num_workers": c.dataloader_num_workers,
            "worker_init_fn": loader_worker_collects if c.dataloader_num_workers else None,
            "pin_memory": c.dataloader_pin_memory and has_cuda,
            "drop_last": c.dataloader_drop_last,
            "persistent_workers": c.dataloader_persistent_workers}


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, torch.utils.data.IterableDataset)


def train_micro_batches(loader: DataLoader, c: TrainConfig) -> int:
    """Micro-batches per epoch; a stream has no length, so its run of max_steps counts as one epoch."""
    if is_stream(loader.dataset):
        return c.max_steps * c.gradient_accumulation_steps
    return len(loader)


def epoch_batches_for(loader: DataLoader) -> Callable[[int, int], Iterable[Any]]:
    """The loop's batches of epoch ``n`` from micro-batch ``skip`` on: the sampler reshuffled for that epoch, or for
    a stream, the stream read again and again (each pass reshuffled by ``set_epoch``) until the loop has its steps.

    A resumed run starts mid-epoch: the sampler skips the samples of the micro-batches already trained by index,
    so they are neither loaded nor collated. A stream has no index: its skipped batches are read again (the buffer
    shuffle and the tokenisation depend only on the seed and the pass number, so the same samples come back in
    the same order).
    """
    if is_stream(loader.dataset):
        def stream_from(_epoch: int, skip: int = 0) -> Iterable[Any]:
            return itertools.islice(stream_passes(loader), skip, None)

        return stream_from

    def for_epoch(epoch: int, skip: int = 0) -> DataLoader:
        if isinstance(loader.batch_sampler, TokenBudgetBatches):  # micro_batch_tokens: skips whole micro-batches
            loader.batch_sampler.set_epoch(epoch)
            loader.batch_sampler.start = skip
            return loader
        set_epoch_of(loader.sampler, epoch)
        if not isinstance(loader.sampler, ResumableSampler):
            raise RuntimeError("the loader's sampler cannot skip; the loader was not built by build_loader")
        loader.sampler.start = skip * (loader.batch_size or 1)
        return loader

    return for_epoch


class ResumableSampler(torch.utils.data.Sampler[int]):
    """A sampler's indices from ``start`` on (``start`` samples skipped without being read)."""

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler = sampler
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.start)


class Reshuffles(Protocol):
    """A sampler or a streamed dataset whose order depends on the pass number."""

    def set_epoch(self, epoch: int) -> None: ...


def reshuffles(source: object) -> TypeGuard[Reshuffles]:
    return hasattr(source, "set_epoch")


def set_epoch_of(source: object, epoch: int) -> None:
    """Reorder ``source`` (this loader's sampler or stream) for pass ``epoch``."""
    if not reshuffles(source):
        raise RuntimeError(f"{type(source).__name__} has no set_epoch; the loader was not built by build_loader")
    source.set_epoch(epoch)



def stream_passes(loader: DataLoader) -> Iterator[Any]:
    from shardtune.errors import DataError

    for number in itertools.count():
        set_epoch_of(loader.dataset, number)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise DataError("streaming: this rank's share of the data holds no trainable sample (too few records "
                            "for the number of processes, empty texts, or prompts longer than cutoff_len); add "
                            "records, use fewer processes or raise cutoff_len")


def sample_lengths(dataset: Any) -> list[int]:
    """Tokens per sample for group_by_length; a preference pair counts its longer answer row."""
    if "chosen_input_ids" in dataset.column_names:
        return [max(len(a), len(b)) for a, b in zip(dataset["chosen_input_ids"], dataset["rejected_input_ids"],
                                                    strict=True)]
    return [len(ids) for ids in dataset["input_ids"]]


def make_sampler(dataset: Any, batch_size: int, engine: Engine, c: TrainConfig, shuffle: bool) -> DistributedSampler:
    """This rank's share of the data (the ranks of a sequence group share one); the seed keeps every rank's view
    of the order the same."""
    if shuffle and c.group_by_length:
        from shardtune.data.sampling import LengthGroupedSampler

        return LengthGroupedSampler(sample_lengths(dataset), batch_size, engine.data_parallel_size,
                                    engine.data_parallel_rank, c.seed)
    return DistributedSampler(dataset, num_replicas=engine.data_parallel_size, rank=engine.data_parallel_rank,
                              shuffle=shuffle,
                              seed=c.seed, drop_last=False)
