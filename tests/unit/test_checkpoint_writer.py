"""Checkpoint writes: staged copies hold the weights of their step, durable order, rotation that a kill cannot break."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.engines.base import PrecisionSettings
from shardtune.engines.checkpoint_writer import CheckpointWriter, HostStaging, staged
from shardtune.engines.local import LocalEngine
from shardtune.train.checkpoint import DELETING_PREFIX, CheckpointSaver, load_checkpoint, rotate_checkpoints
from shardtune.train.checkpoint_folders import complete_checkpoints, latest_checkpoint
from shardtune.train.loop import TrainState


def held_writer() -> tuple[CheckpointWriter, threading.Event]:
    """A background writer whose thread waits for the returned event before writing anything."""
    writer = CheckpointWriter(background=True)
    release = threading.Event()
    writer.submit(lambda: release.wait(30))
    return writer, release


def test_a_staged_file_holds_the_values_of_when_it_was_saved(tmp_path):
    live = torch.arange(6, dtype=torch.float32)
    writer, release = held_writer()
    writer.save_torch({"w": live, "nested": [live[:2]]}, tmp_path / "state.pt")
    writer.save_safetensors({"w": live}, tmp_path / "weights.safetensors")
    live.add_(100)  # the next step changes the weights before the thread wrote a byte
    assert not (tmp_path / "state.pt").exists() or not writer.finished()
    release.set()
    writer.wait()
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(saved["w"], torch.arange(6, dtype=torch.float32))
    assert torch.equal(saved["nested"][0], torch.arange(2, dtype=torch.float32))
    assert torch.equal(load_file(tmp_path / "weights.safetensors")["w"], torch.arange(6, dtype=torch.float32))


def test_staging_copies_tensors_and_keeps_the_rest():
    config = object()
    state = {"a": torch.ones(2), "b": (torch.zeros(1), 3), "c": config}
    copy = staged(state, pin=False)
    assert copy["a"] is not state["a"] and copy["a"].data_ptr() != state["a"].data_ptr()
    assert copy["b"][1] == 3 and copy["c"] is config


def test_a_failed_write_is_raised_by_wait_and_reported_before(tmp_path):
    writer = CheckpointWriter(background=True)
    writer.save_torch({"w": torch.ones(1)}, tmp_path / "missing-folder" / "state.pt")
    with pytest.raises(FileNotFoundError):
        writer.wait()
    assert not writer.pending


def test_without_background_the_file_is_there_when_save_returns(tmp_path):
    writer = CheckpointWriter(background=False)
    writer.save_torch({"w": torch.ones(1)}, tmp_path / "state.pt")
    assert (tmp_path / "state.pt").is_file() and not writer.pending


def tiny_engine() -> LocalEngine:
    engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
    torch.manual_seed(0)
    engine.prepare(torch.nn.Linear(4, 3), lambda params: torch.optim.AdamW(params, lr=0.1),
                   lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda _step: 1.0))
    return engine


def step(engine: LocalEngine) -> None:
    engine.model(torch.ones(2, 4)).sum().backward()
    engine.step(1.0)


def test_an_async_checkpoint_counts_once_written_and_holds_its_steps_weights(tmp_path):
    engine = tiny_engine()
    step(engine)
    at_save = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    saver = CheckpointSaver(engine, tmp_path, save_total_limit=None, background=True)
    release = threading.Event()
    saver.writer.submit(lambda: release.wait(30))  # the write is held back while training goes on
    path = saver.save(TrainState(global_step=1))
    for _ in range(3):
        step(engine)
        saver.poll()
    assert complete_checkpoints(tmp_path) == []  # not complete while its files are being written
    release.set()
    saver.finish()
    assert latest_checkpoint(tmp_path) == path
    marker = json.loads((path / "COMPLETE").read_text())
    assert marker["async_save"] is True and marker["blocked_seconds"] >= 0 and marker["write_seconds"] > 0
    fresh = tiny_engine()
    assert load_checkpoint(fresh, path).global_step == 1
    for name, tensor in fresh.model.named_parameters():
        assert torch.equal(tensor, at_save[name]), name
    saver.close()


def test_poll_marks_complete_once_the_writes_ended(tmp_path):
    engine = tiny_engine()
    saver = CheckpointSaver(engine, tmp_path, save_total_limit=None, background=True)
    saver.save(TrainState(global_step=2))
    for _ in range(200):
        saver.poll()
        if saver.pending is None:
            break
        threading.Event().wait(0.01)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    saver.close()


def test_rotation_renames_before_deleting_and_clears_leftovers(tmp_path):
    for step_number in (1, 2, 3):
        folder = tmp_path / f"checkpoint-{step_number}"
        folder.mkdir()
        (folder / "COMPLETE").write_text("ok\n")
    leftover = tmp_path / f"{DELETING_PREFIX}checkpoint-0"
    leftover.mkdir()
    rotate_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]


def test_a_checkpoint_cut_off_while_deleted_is_never_picked(tmp_path):
    # What a kill between the rename and the deletion leaves: not a checkpoint-<step> folder any more.
    doomed = tmp_path / f"{DELETING_PREFIX}checkpoint-5"
    doomed.mkdir()
    (doomed / "COMPLETE").write_text("ok\n")
    assert latest_checkpoint(Path(tmp_path)) is None


def test_later_stagings_fill_the_host_copies_of_the_first():
    staging = HostStaging(pin=False)
    live = {"w": torch.ones(3), "m": [torch.zeros(2)]}
    first = staging.stage("optimizer.pt", live)
    live["w"].add_(1)
    second = staging.stage("optimizer.pt", live)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # no new allocation
    assert torch.equal(second["w"], torch.full((3,), 2.0))
    grown = staging.stage("optimizer.pt", {"w": torch.ones(4), "m": [torch.zeros(2)]})
    assert grown["w"].shape == (4,) and grown["m"][0].data_ptr() == first["m"][0].data_ptr()


@pytest.mark.parametrize(("version", "state_dict_type", "refused"), [
    (1, "SHARDED_STATE_DICT", True), (1, "FULL_STATE_DICT", False), (2, "SHARDED_STATE_DICT", False)])
def test_async_save_is_refused_only_where_torch_cannot_stage_the_shards(version, state_dict_type, refused):
    from shardtune.config.load import build_config
    from shardtune.engines.plan import plan_engine

    config = build_config({"model_name_or_path": "m", "output_dir": "o", "fsdp": "full_shard auto_wrap",
                           "async_save": True, "fsdp_config": {"fsdp_version": version,
                                                              "fsdp_state_dict_type": state_dict_type}})
    _, problems = plan_engine(config, 2, has_cuda=False)
    said = [p for p in problems if "async_save" in p]
    assert bool(said) is refused and all("fsdp_version" in p for p in said), problems
