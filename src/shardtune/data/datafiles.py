"""Which data files an entry reads: ``file_name`` as a file or a folder, narrowed by ``folder``, ``subset``, ``split``.

LLaMA-Factory passes these three to ``datasets.load_dataset`` for hub datasets. A local copy of a hub dataset
keeps the hub's layout, so they are read the same way here: ``folder`` is a sub-folder of the copy, ``subset``
(a configuration) is a sub-folder below that, and ``split`` selects files the way ``datasets`` infers splits
from names: a file named ``<split>.jsonl``, ``<split>-00000-of-00002.parquet``, ... or any file inside a folder
named ``<split>``. When no file is named for a split, every file belongs to ``train``, as in ``datasets``.
"""

from __future__ import annotations

import re
from pathlib import Path

LOADABLE = (".json", ".jsonl", ".csv", ".parquet")
# Split names datasets recognises in file names (its own keywords, plus the usual short forms).
SPLIT_WORDS = ("train", "training", "test", "testing", "eval", "evaluation", "validation", "valid", "dev")


def pick_data_files(path: Path, folder: str | None, subset: str | None, split: str, where: str
                    ) -> tuple[tuple[Path, ...], list[str]]:
    """The files of ``path`` (a file or folder) that the entry reads, or problems saying why there are none."""
    if path.is_file():
        return single_file(path, folder, subset, split, where)
    base = path
    for key, part in (("folder", folder), ("subset", subset)):
        if part:
            base = base / part
            if not base.is_dir():
                return (), [f"{where}: {key} '{part}' is not a folder inside {base.parent}"
                            f"{listing(base.parent)}"]
    files = sorted(f for f in base.rglob("*") if f.is_file() and f.suffix.lower() in LOADABLE
                   and not any(part.startswith(".") for part in f.relative_to(base).parts))
    if not files:
        return (), [f"{where}: folder {base} holds no data files ({', '.join(LOADABLE)})"]
    kinds = {loader_kind(f) for f in files}
    if len(kinds) > 1:
        return (), [f"{where}: folder {base} mixes file types ({', '.join(sorted(kinds))}); "
                    "keep one type per dataset"]
    return files_of_split(files, base, split, where)


def single_file(path: Path, folder: str | None, subset: str | None, split: str, where: str
                ) -> tuple[tuple[Path, ...], list[str]]:
    problems = [f"{where}: {key} '{value}' needs file_name to name a folder (it picks inside it); "
                f"{path.name} is a file" for key, value in (("folder", folder), ("subset", subset)) if value]
    if split != "train":
        problems.append(f"{where}: split '{split}' cannot be picked from the single file {path.name} (a file "
                        "is all 'train'); point file_name at that split's file, or at a folder of split files")
    return ((), problems) if problems else ((path,), [])


def loader_kind(path: Path) -> str:
    return "json" if path.suffix.lower() in (".json", ".jsonl") else path.suffix.lower().lstrip(".")


def split_of(relative: Path) -> str | None:
    """The split a file belongs to by its name or folder, or None when nothing names one."""
    for part in [*relative.parts[:-1], relative.name]:
        for word in SPLIT_WORDS:
            if re.fullmatch(rf"{word}(?:[-._ 0-9].*)?", part.lower()):
                return word
    return None


def files_of_split(files: list[Path], base: Path, split: str, where: str) -> tuple[tuple[Path, ...], list[str]]:
    named = {f: split_of(f.relative_to(base)) for f in files}
    if all(value is None for value in named.values()):
        if split == "train":
            return tuple(files), []
        return (), [f"{where}: split '{split}' not found: no file in {base} is named for a split, so all of "
                    "them are 'train'"]
    picked = tuple(f for f, value in named.items() if value == split.lower())
    if picked:
        return picked, []
    found = sorted({value for value in named.values() if value})
    return (), [f"{where}: split '{split}' not found in {base}; files there are named for: {', '.join(found)}"]


def listing(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if folder.is_dir() else []
    return f" (folders there: {', '.join(names)})" if names else ""
