"""Translate the config into the explicit settings each component takes, and build those components."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from shardtune.config.schema import TrainConfig
from shardtune.engines.base import Engine
from shardtune.model.adapters import FinetuningSettings, apply_finetuning, count_parameters


def prepare_model_dir(c: TrainConfig, engine: Engine) -> None:
    """Build the tiny demo model once (main rank) when asked and missing; other ranks wait."""
    path = Path(c.model_name_or_path or "")
    if c.build_tiny_model_if_missing and not (path / "config.json").is_file() and engine.is_main:
        from shardtune.model.tiny import build_tiny_model

        print(f"[shardtune] building the tiny demo model in {path}", flush=True)
        build_tiny_model(path)
    engine.barrier()


def load_model_for_training(c: TrainConfig, settings: FinetuningSettings) -> torch.nn.Module:
    from shardtune.model.load import load_causal_lm

    compute_dtype = torch.bfloat16 if c.bf16 else (torch.float16 if c.fp16 else torch.float32)
    model = load_causal_lm(c.model_name_or_path or "", trust_remote_code=c.trust_remote_code,
                           attn_implementation=c.attn_implementation, quantization_bit=c.quantization_bit,
                           compute_dtype=compute_dtype)
    model = apply_finetuning(model, settings)
    trainable, total = count_parameters(model)
    print(f"[shardtune] {c.finetuning_type}: trainable params {trainable:,} of {total:,} "
          f"({100 * trainable / max(total, 1):.4f}%)", flush=True)
    return model


def build_loader(dataset: Any, tokenizer: Any, batch_size: int, engine: Engine, c: TrainConfig,
                 shuffle: bool) -> DataLoader | None:
    """A loader over this rank's share of the data; the sampler's seed keeps ranks' orders consistent."""
    if dataset is None:
        return None
    from shardtune.data import DataCollator

    sampler = DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.rank,
                                 shuffle=shuffle, seed=c.seed, drop_last=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                      collate_fn=DataCollator(tokenizer.pad_token_id, attn_implementation=c.attn_implementation),
                      num_workers=c.dataloader_num_workers)
