"""What a run writes and deletes, checked on the launching host against what is already on disk.

A run writes into ``output_dir`` (its config, logs, ``checkpoint-<step>/`` folders, the model), deletes its own
earlier logs and checkpoints there under ``overwrite_output_dir``, replaces a stale ``checkpoint-<step>`` of its own,
and replaces ``tokenized_path`` when it rebuilds the tokenised data. None of that may reach what the run reads (the
model, adapters, reference model, data, the checkpoint it resumes from) or anything shardtune did not write: each
such case is refused before launch with the fix, so no run ever deletes a user's files.
"""

from __future__ import annotations

from pathlib import Path

from shardtune.config.schema import TrainConfig
from shardtune.data.tokenized import MANIFEST
from shardtune.paths import is_inside, is_run_folder, listed, overlaps, user_entries
from shardtune.train.checkpoint_folders import checkpoint_folders, is_shardtune_checkpoint

# Keys naming folders a run reads: no write may land on them.
READ_FOLDER_KEYS = ("model_name_or_path", "adapter_name_or_path", "ref_model", "ref_model_adapters", "dataset_dir",
                    "resume_from_checkpoint")


def write_problems(c: TrainConfig) -> list[str]:
    """Every way this run would write over or delete something it must not."""
    problems = []
    if c.output_dir:
        problems += output_dir_problems(c, Path(c.output_dir))
    if c.tokenized_path:
        problems += tokenized_path_problems(c, Path(c.tokenized_path))
    return problems


def read_folders(c: TrainConfig) -> list[tuple[str, Path]]:
    """(key, folder) for every local folder the run reads."""
    found = []
    for key in READ_FOLDER_KEYS:
        value = getattr(c, key)
        values = value if isinstance(value, list) else str(value).split(",") if value else []
        found += [(key, Path(v.strip())) for v in values if v.strip() and Path(v.strip()).is_dir()]
    return found


def output_dir_problems(c: TrainConfig, out: Path) -> list[str]:
    """output_dir must not be a folder the run reads, hold someone else's work (unless overwrite_output_dir says
    to write beside it), hold another trainer's checkpoint folders, or be cleared while a checkpoint in it is
    the one to resume from."""
    for key, folder in read_folders(c):
        if key != "resume_from_checkpoint" and is_inside(out, folder) and is_inside(folder, out):
            return [f"output_dir ({out}) is {key}: the run would write its checkpoints and model over the folder "
                    "it reads; choose another output_dir"]
    if c.resume_from_checkpoint and is_inside(out, Path(c.resume_from_checkpoint)):
        return [f"output_dir ({out}) lies inside resume_from_checkpoint ({c.resume_from_checkpoint}); give the "
                "checkpoint's run folder or a new folder as output_dir"]
    if not out.is_dir():
        return []
    problems = foreign_checkpoint_problems(out)
    if c.overwrite_output_dir and c.resume_from_checkpoint and is_inside(Path(c.resume_from_checkpoint), out):
        problems.append(f"overwrite_output_dir (true) would delete {c.resume_from_checkpoint}, the checkpoint that "
                        "resume_from_checkpoint names; remove overwrite_output_dir to resume from it, or copy the "
                        "checkpoint elsewhere first")
    entries = [e for e in user_entries(out) if not is_shardtune_checkpoint(out / e)]
    if entries and not is_run_folder(out) and not c.overwrite_output_dir:
        problems.append(f"output_dir: {out} holds files shardtune did not write ({listed(entries)}); choose an "
                        "empty or new folder, or set overwrite_output_dir: true to write beside them (nothing of "
                        "theirs is deleted)")
    return problems


def foreign_checkpoint_problems(out: Path) -> list[str]:
    """``checkpoint-<step>`` folders another trainer wrote: a save at that step would replace them."""
    foreign = [p.name for p in checkpoint_folders(out) if not is_shardtune_checkpoint(p)]
    if not foreign:
        return []
    return [f"output_dir: {out} holds {listed(foreign)}, which shardtune did not write (another trainer's "
            "checkpoints?); a save at that step would replace them: move them out or choose another output_dir"]


def tokenized_path_problems(c: TrainConfig, folder: Path) -> list[str]:
    """tokenized_path is replaced whole when the data is tokenised again: it must be new, empty or a tokenised
    dataset shardtune saved, and must not contain output_dir."""
    if folder.exists() and not folder.is_dir():
        return [f"tokenized_path: {folder} is a file; give a folder (new, or one an earlier run saved)"]
    if c.output_dir and overlaps(folder, Path(c.output_dir)) and is_inside(Path(c.output_dir), folder):
        return [f"tokenized_path ({folder}) contains output_dir ({c.output_dir}): rebuilding the tokenised data "
                "replaces that folder and would delete the run; give tokenized_path a folder of its own"]
    entries = user_entries(folder)
    if entries and not (folder / MANIFEST).is_file():
        return [f"tokenized_path: {folder} holds files that are not tokenised datasets saved by shardtune "
                f"({listed(entries)}); the run would replace the folder: give a new or empty folder"]
    return []
