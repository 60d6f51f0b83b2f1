"""Finding checkpoints: ``checkpoint-<step>/`` in output_dir, complete only when the marker exists.

No torch import: the launching host checks what a run would resume from (``shardtune check``, and before
``train`` spawns ranks), so a folder that is not a finished checkpoint is one line instead of a rank's traceback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from shardtune import run_files

COMPLETE_MARKER = "COMPLETE"
MODEL_ONLY_MARKER = "MODEL_ONLY"  # save_only_model: the folder holds the model (or adapter), no optimizer state
STATE_FILE = run_files.TRAINER_STATE
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"checkpoint-{step}"


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first (a folder without the marker was interrupted mid-save)."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if (m := _CHECKPOINT.match(p.name)) and (p / COMPLETE_MARKER).is_file()]
    return [p for _, p in sorted(found)]


def is_shardtune_checkpoint(path: Path) -> bool:
    """A ``checkpoint-<step>`` folder shardtune wrote, finished or cut off while saving (it holds the run's config,
    copied first, or a rank's RNG state), as opposed to another trainer's checkpoint of the same name."""
    return (path / COMPLETE_MARKER).is_file() or (path / run_files.RESOLVED_CONFIG).is_file() or \
        any(path.glob("rank*_rng_state.pt"))


def checkpoint_folders(output_dir: Path) -> list[Path]:
    """Every ``checkpoint-<step>`` folder in output_dir, whoever wrote it."""
    if not output_dir.is_dir():
        return []
    return sorted(p for p in output_dir.iterdir() if _CHECKPOINT.match(p.name) and p.is_dir())


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def resume_source(config) -> Path | None:
    """The checkpoint a run resumes from: the one named, else the latest complete one unless overwriting."""
    if config.resume_from_checkpoint:
        return Path(config.resume_from_checkpoint)
    if config.overwrite_output_dir or not config.output_dir:
        return None
    return latest_checkpoint(Path(config.output_dir))


def checkpoint_problems(path: Path, key: str = "resume_from_checkpoint") -> list[str]:
    """Why ``path`` cannot be resumed from (empty when it is a finished checkpoint with readable progress)."""
    if not path.is_dir():
        return [f"{key}: folder not found: {path}" if not path.exists() else
                f"{key}: {path} is a file; give a checkpoint-<step> folder"]
    if not (path / COMPLETE_MARKER).is_file():
        return [f"{key}: {path} is not a finished checkpoint (no {COMPLETE_MARKER} marker){_instead(path, path)}"]
    state = path / STATE_FILE
    try:
        data = json.loads(state.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"{key}: {path} lacks {STATE_FILE}; the checkpoint is damaged{_instead(path, path)}"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return [f"{key}: {state} cannot be read ({err}); the checkpoint is damaged{_instead(path, path)}"]
    if not isinstance(data, dict) or not isinstance(data.get("global_step"), int):
        return [f"{key}: {state} has no global_step; the checkpoint is damaged{_instead(path, path)}"]
    return []


def _instead(folder: Path, broken: Path) -> str:
    """What to resume from instead: the latest other finished checkpoint in ``folder`` or beside it."""
    candidates = complete_checkpoints(folder)
    if not candidates and _CHECKPOINT.match(folder.name):
        candidates = complete_checkpoints(folder.parent)
    candidates = [c for c in candidates if c.resolve() != broken.resolve()]
    if candidates:
        return f"; did you mean {candidates[-1]}?"
    return ("; point it at a checkpoint-<step> folder that has one (a save interrupted before the marker "
            "was written cannot be resumed), or set overwrite_output_dir: true to start afresh")
