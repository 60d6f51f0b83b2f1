"""Engines behind one interface; ``build_engine`` picks the one the config and launcher ask for."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig
    from shardtune.engines.base import Engine


def build_engine(config: TrainConfig) -> Engine:
    import torch

    from shardtune.engines.base import PrecisionSettings
    from shardtune.engines.local import LocalEngine

    precision = PrecisionSettings(bf16=config.bf16, fp16=config.fp16)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return LocalEngine(precision, device)
