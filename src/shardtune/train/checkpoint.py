"""Saving and loading checkpoints (engine state, progress, RNG); finding them is in checkpoint_folders.py."""

from __future__ import annotations

import dataclasses
import json
import random
import secrets
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardtune import run_files
from shardtune.config.adapter_method import is_adapter_type
from shardtune.config.schema import TrainConfig
from shardtune.engines.base import Engine
from shardtune.engines.checkpoint_writer import (
    CheckpointWriter,
    SaveTimes,
    fault_point,
    fsync_path,
    fsync_tree,
    save_torch_file,
    write_durably,
)
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
from shardtune.train.loop import KeepsCheckpointState, TrainState

RNG_FILE = "rng_state.pt"


def save_checkpoint(engine: Engine, output_dir: Path, state: TrainState, save_total_limit: int | None,
                    model_only: bool = False) -> Path:
    """Write engine state (or, ``model_only``, the model as the final save writes it), progress and RNG, all at
    once; the marker goes last so a crash never leaves a 'complete' half."""
    saver = CheckpointSaver(engine, output_dir, save_total_limit, background=False)
    try:
        return saver.save(state, model_only)
    finally:
        saver.close()


@dataclass
class PendingCheckpoint:
    """A checkpoint whose files are still being written: its folder, the progress of its step, what it cost."""

    path: Path
    progress: dict[str, Any]
    model_only: bool
    blocked_seconds: float


SavedCallback = Callable[[int, SaveTimes], None]


class CheckpointSaver:
    """Saves checkpoints as every rank's engine and writer produce them, and marks each complete once every rank's
    files are written, flushed and fsynced (``COMPLETE`` last, then the old ones rotate out).

    ``background`` (``async_save``): a save stages this rank's state into host memory and returns; ``poll`` (called
    between steps: a collective while a checkpoint is being written) marks it complete once every rank's writer
    has finished; the next save, and the run's end (``finish``), wait for the writes first. At most one checkpoint
    per rank is ever staged."""

    def __init__(self, engine: Engine, output_dir: Path, save_total_limit: int | None, background: bool,
                 on_saved: SavedCallback | None = None) -> None:
        self.engine = engine
        self.output_dir = output_dir
        self.save_total_limit = save_total_limit
        self.writer = CheckpointWriter(background, pin=engine.device.type == "cuda")
        self.on_saved = on_saved
        self.pending: PendingCheckpoint | None = None

    def save(self, state: TrainState, model_only: bool = False, objective: object = None) -> Path:
        """This rank's share of checkpoint-<step>: the engine's state (or the model), RNG, and the objective's own
        files where it keeps state (``KeepsCheckpointState``)."""
        started = time.perf_counter()
        self.finish()  # the previous checkpoint's writes first
        path = checkpoint_dir(self.output_dir, state.global_step)
        if self.engine.is_main:
            prepare_checkpoint_folder(path, self.output_dir)
        self.engine.barrier()
        fault_point("stage")
        with self.writer.staging():
            if model_only:
                self.engine.save_model(path)  # Hugging Face files, written at once (async_save refuses model-only)
            else:
                self.engine.save_state(path, self.writer)
            self.writer.save_torch(rng_state(), path / f"rank{self.engine.rank}_{RNG_FILE}")
            if isinstance(objective, KeepsCheckpointState):
                for name, payload in objective.checkpoint_files(self.engine).items():
                    self.writer.save_torch(payload, path / name)
        fault_point("staged")
        self.pending = PendingCheckpoint(path, state.to_dict(), model_only, time.perf_counter() - started)
        if not self.writer.background:
            self.finish()
        return path

    def poll(self) -> None:
        """Between steps: mark the checkpoint in flight complete once every rank's writes ended (all ranks call
        this together; nothing happens, and nothing is exchanged, without one in flight)."""
        if self.pending is None:
            return
        failed = self.writer.failure() is not None
        flags = self.engine.all_reduce_sum(torch.tensor([0 if self.writer.finished() else 1, int(failed)],
                                                        dtype=torch.int64, device=self.engine.device))
        if int(flags[1]) or int(flags[0]) == 0:
            self.finish()

    def finish(self) -> None:
        """Every rank: wait for this rank's writes, then the checkpoint is marked complete (or, when a rank's write
        failed, every rank raises)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        error: BaseException | None = None
        written = 0.0
        try:
            written = self.writer.wait()
        except Exception as err:  # noqa: BLE001 - re-raised below, once every rank knows
            error = err
        failures = self.engine.all_reduce_sum(torch.tensor([int(error is not None)], dtype=torch.int64,
                                                           device=self.engine.device))
        if error is not None:
            raise RuntimeError(f"checkpoint {pending.path}: writing this rank's files failed: {error}") from error
        if int(failures[0]):
            raise RuntimeError(f"checkpoint {pending.path}: another rank's write failed (its log says why); the "
                               "latest complete checkpoint stays the one to resume from")
        # Without a background writer the files were written inside the save: its held time is their write time.
        times = SaveTimes(pending.blocked_seconds, written if self.writer.background else pending.blocked_seconds)
        if self.engine.is_main:
            complete_checkpoint(pending, self.output_dir, self.save_total_limit, times, self.writer.background)
        self.engine.barrier()
        if self.on_saved is not None:
            self.on_saved(int(pending.progress["global_step"]), times)

    def close(self) -> None:
        self.writer.close()


def prepare_checkpoint_folder(path: Path, output_dir: Path) -> None:
    """An empty ``checkpoint-<step>`` holding the run's config (first: it marks the folder as ours)."""
    if path.exists():  # our own save of this step, cut off (the launching host refused anyone else's)
        assert is_shardtune_checkpoint(path), f"{path} was not written by shardtune"
        shutil.rmtree(path)
    path.mkdir(parents=True)
    run_config = output_dir / run_files.RESOLVED_CONFIG
    if run_config.is_file():
        shutil.copyfile(run_config, path / run_files.RESOLVED_CONFIG)


def complete_checkpoint(pending: PendingCheckpoint, output_dir: Path, save_total_limit: int | None,
                        times: SaveTimes, in_background: bool) -> None:
    """Rank 0, once every rank's files are written: progress, everything fsynced, then the ``COMPLETE`` marker
    (itself fsynced, and the folders' entries; it holds rank 0's save times for the run page), and only then the
    old checkpoints rotated out."""
    write_durably(pending.path / STATE_FILE, json.dumps(pending.progress, indent=2))
    if pending.model_only:
        write_durably(pending.path / MODEL_ONLY_MARKER, "model weights only: the optimizer restarts on resume\n")
    fsync_tree(pending.path)
    fault_point("before-marker")
    write_durably(pending.path / COMPLETE_MARKER, json.dumps({
        "async_save": in_background, "blocked_seconds": round(times.blocked, 4),
        "write_seconds": round(times.written, 4)}) + "\n")
    fsync_path(output_dir)
    fault_point("after-marker")
    rotate_checkpoints(output_dir, save_total_limit)


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


DELETING_PREFIX = ".deleting-"


def rotate_checkpoints(output_dir: Path, save_total_limit: int | None) -> None:
    """Delete all but the newest ``save_total_limit`` complete checkpoints. Each is first renamed out of the
    ``checkpoint-<step>`` pattern (one atomic step), so a kill during the deletion never leaves a half-deleted
    folder that still looks complete; leftovers of such a kill go on the next rotation."""
    for leftover in output_dir.glob(f"{DELETING_PREFIX}checkpoint-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if not save_total_limit:
        return
    for old in complete_checkpoints(output_dir)[:-save_total_limit]:
        doomed = old.with_name(DELETING_PREFIX + old.name)
        old.rename(doomed)
        fsync_path(output_dir)
        fault_point("rotate")
        shutil.rmtree(doomed, ignore_errors=True)


def is_model_only(path: Path) -> bool:
    return (path / MODEL_ONLY_MARKER).is_file()


def load_checkpoint(engine: Engine, path: Path, objective: object = None) -> TrainState:
    """Restore everything (the objective's own state too, ``KeepsCheckpointState``); a model-only checkpoint's
    weights were loaded with the model (``model_only_config``), so here only progress, RNG, the objective's state and
    the learning-rate schedule's position come back."""
    if isinstance(objective, KeepsCheckpointState):
        objective.restore_from(engine, path)
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
    save_torch_file(rng_state(), path)


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
