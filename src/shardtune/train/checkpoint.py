"""Saving and loading checkpoints (engine state, progress, RNG); finding them is in checkpoint_folders.py."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from shardtune.engines.base import Engine
from shardtune.train.checkpoint_folders import (  # noqa: F401 - discovery lives there, torch-free
    COMPLETE_MARKER,
    STATE_FILE,
    checkpoint_dir,
    complete_checkpoints,
    latest_checkpoint,
    resume_source,
)
from shardtune.train.loop import TrainState

RNG_FILE = "rng_state.pt"


def save_checkpoint(engine: Engine, output_dir: Path, state: TrainState, save_total_limit: int | None) -> Path:
    """Write engine state, progress and RNG; the marker goes last so a crash never leaves a 'complete' half."""
    path = checkpoint_dir(output_dir, state.global_step)
    if engine.is_main:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    engine.barrier()
    engine.save_state(path)
    save_rng_file(path / f"rank{engine.rank}_{RNG_FILE}")
    engine.barrier()
    if engine.is_main:
        (path / STATE_FILE).write_text(json.dumps(state.to_dict(), indent=2))
        (path / COMPLETE_MARKER).write_text("ok\n")
        rotate_checkpoints(output_dir, save_total_limit)
    engine.barrier()
    return path


def rotate_checkpoints(output_dir: Path, save_total_limit: int | None) -> None:
    if not save_total_limit:
        return
    for old in complete_checkpoints(output_dir)[:-save_total_limit]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(engine: Engine, path: Path) -> TrainState:
    engine.load_state(path)
    rng_file = path / f"rank{engine.rank}_{RNG_FILE}"
    if rng_file.is_file():
        load_rng_file(rng_file)
    data = json.loads((path / STATE_FILE).read_text())
    data.pop("interrupted", None)
    return TrainState(**data)


def save_rng_file(path: Path) -> None:
    torch.save(rng_state(), path)


def load_rng_file(path: Path) -> None:
    # RNG states are CPU byte tensors, whatever device the run used.
    restore_rng_state(torch.load(path, map_location="cpu", weights_only=True))


def rng_state() -> dict:
    """Python, numpy and torch CPU generators, plus the current CUDA device's once CUDA is in use."""
    state = {
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2],
        "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
        "numpy_pos": int(np.random.get_state()[2]),
        "torch": torch.get_rng_state(),
    }
    # Asking before CUDA is initialised would initialise it (a CPU-only run that merely has a GPU stays off it).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: each rank sets its own at start-up
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    # A checkpoint written on GPUs and resumed without CUDA keeps the CPU generators only.
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
