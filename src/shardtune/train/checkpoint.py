"""Saving and loading checkpoints (engine state, progress, RNG); finding them is in checkpoint_folders.py."""

from __future__ import annotations

import dataclasses
import json
import random
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardtune import run_files
from shardtune.config.adapter_method import is_adapter_type
from shardtune.config.schema import TrainConfig
from shardtune.engines.base import Engine
from shardtune.errors import ConfigError
from shardtune.model.pretrained_adapters import plan_adapters
from shardtune.train.checkpoint_folders import (  # noqa: F401 - discovery lives there, torch-free
    COMPLETE_MARKER,
    MODEL_ONLY_MARKER,
    STATE_FILE,
    checkpoint_dir,
    complete_checkpoints,
    is_shardtune_checkpoint,
    latest_checkpoint,
    resume_source,
)
from shardtune.train.loop import TrainState

RNG_FILE = "rng_state.pt"


def save_checkpoint(engine: Engine, output_dir: Path, state: TrainState, save_total_limit: int | None,
                    model_only: bool = False) -> Path:
    """Write engine state (or, ``model_only``, the model as the final save writes it), progress and RNG; the
    marker goes last so a crash never leaves a 'complete' half."""
    path = checkpoint_dir(output_dir, state.global_step)
    if engine.is_main:
        if path.exists():  # our own save of this step, cut off (the launching host refused anyone else's)
            assert is_shardtune_checkpoint(path), f"{path} was not written by shardtune"
            shutil.rmtree(path)
        path.mkdir(parents=True)
        run_config = output_dir / run_files.RESOLVED_CONFIG
        if run_config.is_file():  # first: it marks the folder as ours and says what layout it holds
            shutil.copyfile(run_config, path / run_files.RESOLVED_CONFIG)
    engine.barrier()
    if model_only:
        engine.save_model(path)
    else:
        engine.save_state(path)
    save_rng_file(path / f"rank{engine.rank}_{RNG_FILE}")
    engine.barrier()
    if engine.is_main:
        (path / STATE_FILE).write_text(json.dumps(state.to_dict(), indent=2))
        if model_only:
            (path / MODEL_ONLY_MARKER).write_text("model weights only: the optimizer restarts on resume\n")
        (path / COMPLETE_MARKER).write_text("ok\n")
        rotate_checkpoints(output_dir, save_total_limit)
    engine.barrier()
    return path


def agreed_resume_source(engine: Engine, config: TrainConfig, output_dir: Path) -> Path | None:
    """The checkpoint every rank resumes from, as rank 0 finds it, once every rank has shown it sees rank 0's
    output_dir (after rank 0 created it).

    Ranks on nodes with a folder of their own (a pod's own disk) would crash at the first checkpoint, whose folder
    only rank 0 creates, and choose other checkpoints on resume: every rank refuses them together instead (the
    node check refuses them before launch where it runs, launch/nodes.py).
    """
    token, step_plus_one = 0, 0  # every rank but 0 adds zeros: the sums are rank 0's values
    if engine.is_main:
        token = secrets.randbits(52) + 1
        path = output_dir / run_files.RUN_TOKEN
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(token))
        step_plus_one = _checkpoint_step(resume_source(config), output_dir) + 1
    agreed = engine.all_reduce_sum(torch.tensor([token, step_plus_one], dtype=torch.int64, device=engine.device))
    token, step = int(agreed[0]), int(agreed[1]) - 1
    unseen = engine.all_reduce_sum(torch.tensor([0 if _run_token(output_dir) == str(token) else 1],
                                                dtype=torch.int64, device=engine.device))
    if int(unseen[0]):
        raise ConfigError(f"output_dir {output_dir} is not shared by every rank: {int(unseen[0])} of "
                          f"{engine.world_size} ranks cannot see the file rank 0 wrote there (a folder of each "
                          "node's own?); every rank writes its part of each checkpoint into output_dir and resumes "
                          "from it: put output_dir on storage every node mounts (NFS, Lustre, a ReadWriteMany "
                          "volume in every pod)")
    if config.resume_from_checkpoint:
        return Path(config.resume_from_checkpoint)
    return checkpoint_dir(output_dir, step) if step >= 0 else None


def _checkpoint_step(source: Path | None, output_dir: Path) -> int:
    """The step of rank 0's checkpoint-<step> in output_dir; -1 for none (or one named by
    resume_from_checkpoint, which every rank reads itself)."""
    if source is None or source.parent != output_dir or not source.name.startswith("checkpoint-"):
        return -1
    step = source.name.removeprefix("checkpoint-")
    return int(step) if step.isdigit() else -1


def _run_token(output_dir: Path) -> str | None:
    try:
        return (output_dir / run_files.RUN_TOKEN).read_text().strip()
    except OSError:
        return None


def rotate_checkpoints(output_dir: Path, save_total_limit: int | None) -> None:
    if not save_total_limit:
        return
    for old in complete_checkpoints(output_dir)[:-save_total_limit]:
        shutil.rmtree(old, ignore_errors=True)


def is_model_only(path: Path) -> bool:
    return (path / MODEL_ONLY_MARKER).is_file()


def load_checkpoint(engine: Engine, path: Path) -> TrainState:
    """Restore everything; a model-only checkpoint's weights were loaded with the model (``model_only_config``),
    so here only progress, RNG and the learning-rate schedule's position come back."""
    if is_model_only(path):
        state = load_progress(engine, path)
        fast_forward_schedule(engine.scheduler, state.global_step)
        return state
    engine.load_state(path)
    return load_progress(engine, path)


def load_progress(engine: Engine, path: Path) -> TrainState:
    """Step counters and loss history, and this rank's random generators."""
    rng_file = path / f"rank{engine.rank}_{RNG_FILE}"
    if rng_file.is_file():
        load_rng_file(rng_file)
    data = json.loads((path / STATE_FILE).read_text())
    data.pop("interrupted", None)
    return TrainState(**data)


def fast_forward_schedule(scheduler: Any, steps: int) -> None:
    """Put a fresh learning-rate schedule where the checkpoint's run left it (its state was not saved)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": intended here
        for _ in range(steps):
            scheduler.step()


def model_only_config(config: TrainConfig, path: Path) -> TrainConfig:
    """The config that builds the model from a model-only checkpoint: an adapter (LoRA, OFT) run trains the saved
    adapter on (earlier adapters still merged first), other runs start from the saved full weights."""
    if is_adapter_type(config.finetuning_type):
        merged = plan_adapters(tuple(config.adapter_name_or_path), config.create_new_adapter).to_merge
        return dataclasses.replace(config, adapter_name_or_path=[*merged, str(path)], create_new_adapter=False)
    return dataclasses.replace(config, model_name_or_path=str(path), adapter_name_or_path=[])


def save_rng_file(path: Path) -> None:
    torch.save(rng_state(), path)


def load_rng_file(path: Path) -> None:
    # RNG states are CPU byte tensors, whatever device the run used.
    restore_rng_state(torch.load(path, map_location="cpu", weights_only=True))


def rng_state() -> dict:
    """Python, numpy and torch CPU generators, plus the current CUDA device's once CUDA is in use."""
    _, numpy_keys, numpy_pos, _, _ = numpy_legacy_state()
    state = {
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2],
        "numpy": torch.from_numpy(numpy_keys.astype(np.int64)),
        "numpy_pos": int(numpy_pos),
        "torch": torch.get_rng_state(),
    }
    # Asking before CUDA is initialised would initialise it (a CPU-only run that merely has a GPU stays off it).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: each rank sets its own at start-up
    return state


def numpy_legacy_state() -> tuple[str, np.ndarray, int, int, float]:
    """numpy's global MT19937 state as its legacy tuple (numpy's stubs type a plain ``get_state()`` as a dict)."""
    state = np.random.get_state(legacy=True)
    if not isinstance(state, tuple):
        raise RuntimeError(f"numpy's global generator is {state.get('bit_generator')}, not MT19937")
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    # A checkpoint written on GPUs and resumed without CUDA keeps the CPU generators only.
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
