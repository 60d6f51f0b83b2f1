"""A finished run's output_dir is refused unless overwriting or resuming; the refusal names the checkpoint to go on
from (on the GPU a test that raised max_steps and ran again met the refusal without that hint, 2026-11-28)."""

from __future__ import annotations

from shardtune.config.schema import TrainConfig
from shardtune.launch.validate import output_dir_problems


def finished_run(tmp_path, checkpoints=()):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train_results.json").write_text("{}")
    for step in checkpoints:
        (out / f"checkpoint-{step}").mkdir()
        (out / f"checkpoint-{step}" / "COMPLETE").write_text("")
    return out


def test_the_refusal_names_the_last_complete_checkpoint(tmp_path):
    out = finished_run(tmp_path, checkpoints=(2, 4))
    (out / "checkpoint-6").mkdir()  # not finished: no marker
    (problem,) = output_dir_problems(TrainConfig(output_dir=str(out), overwrite_output_dir=False))
    assert "already holds a finished run" in problem
    assert f"set resume_from_checkpoint: {out / 'checkpoint-4'} to train on from its last checkpoint" in problem


def test_without_checkpoints_only_overwrite_and_another_folder_are_offered(tmp_path):
    out = finished_run(tmp_path)
    (problem,) = output_dir_problems(TrainConfig(output_dir=str(out), overwrite_output_dir=False))
    assert "resume_from_checkpoint" not in problem and "overwrite_output_dir: true" in problem


def test_resuming_or_overwriting_is_not_refused(tmp_path):
    out = finished_run(tmp_path, checkpoints=(4,))
    assert output_dir_problems(TrainConfig(output_dir=str(out), resume_from_checkpoint=str(out / "checkpoint-4"),
                                           overwrite_output_dir=False)) == []
    assert output_dir_problems(TrainConfig(output_dir=str(out), overwrite_output_dir=True)) == []
