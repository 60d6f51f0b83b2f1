"""Checkpoint folders count only when complete; rotation and auto-resume ignore interrupted saves."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardtune.config.load import build_config
from shardtune.train.checkpoint import (
    COMPLETE_MARKER,
    complete_checkpoints,
    latest_checkpoint,
    resume_source,
    rotate_checkpoints,
)


def make(out: Path, step: int, complete: bool = True) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / COMPLETE_MARKER).write_text("ok\n")
    return path


def test_interrupted_save_is_never_the_latest(tmp_path):
    make(tmp_path, 3)
    make(tmp_path, 10)
    make(tmp_path, 12, complete=False)  # killed while saving
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-10"]


def test_rotation_keeps_the_newest_complete(tmp_path):
    for step in (2, 4, 6):
        make(tmp_path, step)
    make(tmp_path, 8, complete=False)
    rotate_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]


def test_resume_source_rules(tmp_path):
    make(tmp_path, 5)
    base = {"model_name_or_path": "org/m", "dataset": "demo", "output_dir": str(tmp_path)}
    assert resume_source(build_config(base)) == tmp_path / "checkpoint-5"
    assert resume_source(build_config({**base, "overwrite_output_dir": True})) is None
    named = build_config({**base, "resume_from_checkpoint": "/elsewhere/checkpoint-1"})
    assert resume_source(named) == Path("/elsewhere/checkpoint-1")


class Payload:
    """Stands for an object a tampered checkpoint could carry; unpickling it would run its code."""

    def __reduce__(self):
        return (print, ("unpickled!",))


def test_deepspeed_reads_are_forced_to_weights_only(tmp_path, capsys):
    import pickle

    import torch

    from shardtune.engines.safe_load import weights_only_loads

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "extra": Payload()}, path)
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        torch.load(path, weights_only=False)  # what DeepSpeed's loaders pass
    assert "unpickled!" not in capsys.readouterr().out
    torch.save({"module": {"w": torch.ones(2)}}, path)
    with weights_only_loads():
        assert torch.load(path, weights_only=False)["module"]["w"].sum() == 2


def test_an_fp16_loss_scaler_state_loads_through_the_safe_loader(tmp_path, capsys):
    """fp16 ZeRO saves its DynamicLossScaler object in the optimizer state: resume and export read it back."""
    import torch
    from deepspeed.checkpoint.constants import LOSS_SCALER, OPTIMIZER_STATE_DICT
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler
    from deepspeed.runtime.precision_config import get_float16_config

    from shardtune.engines.safe_load import weights_only_loads

    # What ZeRO-1/2/3 build from an fp16 config with dynamic scaling ("loss_scale": 0, DeepSpeed's default).
    fp16 = get_float16_config({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}})
    scaler = CreateLossScaler(dtype=torch.float16, static_loss_scale=fp16.loss_scale, dynamic_scaling=True,
                              dynamic_loss_args=fp16.dynamic_loss_scale_args())
    scaler.update_scale(False)
    path = tmp_path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({OPTIMIZER_STATE_DICT: {LOSS_SCALER: scaler, "dynamic_loss_scale": True, "overflow": False}}, path)
    with weights_only_loads():
        loaded = torch.load(path, weights_only=False)[OPTIMIZER_STATE_DICT][LOSS_SCALER]
    assert isinstance(loaded, DynamicLossScaler)
    assert (loaded.cur_scale, loaded.cur_iter, loaded.dtype) == (2**12, 1, torch.float16)
    # Still only the allowed classes: anything else in the same file is refused.
    torch.save({OPTIMIZER_STATE_DICT: {LOSS_SCALER: scaler, "extra": Payload()}}, path)
    with weights_only_loads(), pytest.raises(Exception, match="Unsupported global"):
        torch.load(path, weights_only=False)
    assert "unpickled!" not in capsys.readouterr().out
