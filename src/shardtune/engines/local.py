"""One process, no distribution: the engine for `shardtune train` on a single device."""

from __future__ import annotations

from shardtune.engines.torch_native import TorchEngine


class LocalEngine(TorchEngine):
    name = "local"
