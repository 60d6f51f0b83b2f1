"""DeepSpeed's checkpoint files written through shardtune's checkpoint writer (engines/checkpoint_writer.py).

DeepSpeed hands every file of ``save_checkpoint`` (the module states, each rank's ZeRO partitions) to its engine's
``checkpoint_engine.save(state_dict, path)``. This one writes them flushed and fsynced, and under ``async_save``
stages each state into host memory of its own before returning, so DeepSpeed's next steps (which update the very
fp32 partitions and Adam moments it handed over) cannot reach the files. The layout is DeepSpeed's own: resume,
re-splitting onto another world size and ``zero_to_fp32`` read it as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from shardtune.engines.checkpoint_writer import CheckpointWriter


class WriterCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine interface over a ``CheckpointWriter``; loading is torch's, as DeepSpeed's own."""

    def __init__(self, writer: CheckpointWriter) -> None:
        super().__init__()
        self.name = "ShardtuneCheckpointEngine"
        self.writer = writer

    def create(self, info: CheckpointCommitInfo) -> None:
        return None

    def save(self, state_dict: Any, path: str) -> None:
        self.writer.save_torch(state_dict, Path(path))

    def load(self, path: str, map_location: Any = None) -> Any:
        # Installed for saves only (DeepSpeedEngine.save_state); a load through it reads tensors and the DeepSpeed
        # config objects that weights_only_loads (engines/safe_load.py) allows, nothing else.
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        # Whether the checkpoint counts is decided once every rank's writes ended (train/checkpoint.py).
        return True

    def preserves_storage_sharing(self) -> bool:
        return not self.writer.background  # staged copies are tensors of their own already


@contextlib.contextmanager
def writing_through(ds_engine: Any, writer: CheckpointWriter) -> Iterator[None]:
    """DeepSpeed's engine saves through ``writer`` inside this block; its own checkpoint engine (which its loads use)
    is back afterwards."""
    own = ds_engine.checkpoint_engine
    ds_engine.checkpoint_engine = WriterCheckpointEngine(writer)
    try:
        yield
    finally:
        ds_engine.checkpoint_engine = own


def convert_to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` on a checkpoint's ZeRO shards, in a child process that loads weights only."""
    import subprocess
    import sys

    from shardtune.errors import ModelError

    argv = [sys.executable, "-m", "shardtune.engines.safe_load", "deepspeed.checkpoint.ds_to_universal",
            "--input_folder", str(source),
            "--output_folder", str(target)]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or ["(no message)"]
        raise ModelError(f"checkpoint {source} cannot be converted for a different world size: {tail[0]}; resume "
                         "with the number of processes that wrote it, or `shardtune export` it and start from that")
