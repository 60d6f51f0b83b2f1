"""Where an export may write, and writing it so that nothing is destroyed.

The rules: the destination is never the source or the base model, nor a folder that contains either (replacing
it would delete them); an existing non-empty folder is replaced only when it is an earlier export (it carries
``EXPORT_MARKER``) or when ``overwrite`` is given; a file is never replaced. The new folder is written under a
hidden temporary name beside the destination and renamed into place once complete, so a killed export leaves the
destination as it was (and a hidden ``.NAME.partial-PID`` folder that the next export to NAME removes).

Which folders a run may write is the write guard's (launch/write_guard.py); both ask ``shardtune.paths``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from shardtune.errors import ConfigError
from shardtune.host import process_alive
from shardtune.paths import is_inside, user_entries

EXPORT_MARKER = "shardtune_export.json"  # what was exported from where; marks a folder as an export
PARTIAL = ".partial-"


def is_earlier_export(folder: Path) -> bool:
    return (folder / EXPORT_MARKER).is_file()


def destination_problem(out: Path, protected: dict[str, Path], overwrite: bool, name: str = "--out") -> str | None:
    """Why ``out`` may not be written (one line naming the flag or path that fixes it), or None.

    ``protected``: what must survive, by role (``{"the source": ..., "the base model": ...}``); ``name``: what
    the user called ``out`` (``--out``, or ``export_dir`` in a YAML file)."""
    for role, path in protected.items():
        if is_inside(path, out):
            what = "is" if path.resolve() == out.resolve() else "contains"
            return (f"export: {name} {out} {what} {role} ({path}); writing there would delete it: choose another "
                    "folder")
    if out.exists() and not out.is_dir():
        return f"export: {name} {out} is a file; choose a folder"
    if user_entries(out) and not is_earlier_export(out) and not overwrite:
        return (f"export: {name} {out} is a folder with files in it that is not an earlier export; choose an empty "
                "or new folder, or pass --overwrite to replace it")
    return None


def check_destination(out: Path, protected: dict[str, Path], overwrite: bool, name: str = "--out") -> None:
    problem = destination_problem(out, protected, overwrite, name)
    if problem:
        raise ConfigError(problem)


@contextlib.contextmanager
def staged_folder(out: Path, record: dict[str, object]) -> Iterator[Path]:
    """A temporary folder to write the export into; on success it becomes ``out`` (replacing what was there),
    marked with ``record``. On an error the temporary folder is removed and ``out`` is untouched."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    staging = out.parent / f".{out.name}{PARTIAL}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        (staging / EXPORT_MARKER).write_text(json.dumps(record, indent=2) + "\n")
        replace_folder(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def replace_folder(new: Path, out: Path) -> None:
    """Put ``new`` at ``out``: the old folder is moved aside first and deleted only after the rename."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def remove_stale_partials(out: Path) -> None:
    """Temporary folders of earlier exports to ``out`` whose process is gone."""
    for stale in out.parent.glob(f".{out.name}{PARTIAL}*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and process_alive(int(pid), None) is False:
            shutil.rmtree(stale, ignore_errors=True)

