"""torch's distributed checkpoint written in the background (FSDP's sharded state under ``async_save``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


class DcpBackground:
    """What a run's background DCP saves share: a gloo group of their own (torch plans and writes in a thread, whose
    collectives must never meet the ones the training steps run meanwhile), made by every rank together at the first
    save; and torch's stager, kept for the run so that later saves copy into host memory already there (pinned on a
    GPU). The next save waits for the previous one's writes (train/checkpoint.py)."""

    def __init__(self, device: torch.device) -> None:
        self.group = dist.new_group(backend="gloo")
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=device.type == "cuda", use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=False))

    def save(self, state: dict[str, Any], folder: str) -> Any:
        """Stage ``state`` now; the future of its write."""
        return dcp.async_save(state, checkpoint_id=folder, process_group=self.group, async_stager=self.stager)
