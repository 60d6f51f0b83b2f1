"""``tokenized_path``: the tokenised (and packed) datasets saved once, loaded by later runs and other ranks.

The folder holds a ``DatasetDict`` (``train`` and, with ``val_size``, ``eval``) and ``shardtune_data.json``
recording what produced it: the data settings, the data files' sizes and modification times, the
tokenizer and the source of ``shardtune.data``. A run whose inputs differ is refused with what differs,
so a stale cache never trains silently; ``overwrite_cache: true`` rebuilds it. The folder is written
under a temporary name and renamed into place, so an interrupted save never leaves a half cache that a
later run would load.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shardtune.data.settings import DataSettings, dataset_names
from shardtune.errors import DataError

MANIFEST = "shardtune_data.json"
# Settings that change how the data is prepared but not what it is.
NOT_IN_KEY = ("preprocessing_num_workers", "overwrite_cache")


def cache_key(settings: DataSettings, tokenizer: Any) -> dict[str, Any]:
    """What a saved dataset must have been built from to be reused, as JSON-friendly values."""
    from datasets.fingerprint import Hasher

    from shardtune.data.caching import source_digest
    from shardtune.data.registry import resolve_entries

    entries, _ = resolve_entries([*dataset_names(settings), *settings.eval_dataset], settings.dataset_dir)
    files = {}
    for entry in entries:
        for path in entry.data_files:
            stat = path.stat()
            files[str(path)] = f"{stat.st_size}:{stat.st_mtime_ns}"
    data = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items() if k not in NOT_IN_KEY}
    return {"settings": data, "files": files, "tokenizer": Hasher.hash(tokenizer), "code": source_digest()}


def is_saved(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Human-readable names of what differs between two cache keys."""
    found = [f"{name}: {saved['settings'].get(name)!r} then, {value!r} now"
             for name, value in wanted["settings"].items() if saved["settings"].get(name) != value]
    if saved["files"] != wanted["files"]:
        found.append("the data files changed")
    if saved["tokenizer"] != wanted["tokenizer"]:
        found.append("the tokenizer changed")
    if saved["code"] != wanted["code"]:
        found.append("shardtune's data processing changed")
    return found


def is_current(path: str | Path, wanted: dict[str, Any] | None) -> bool:
    """Saved, and (when ``wanted`` is given) from the same inputs."""
    if not is_saved(path):
        return False
    return wanted is None or not differences(json.loads((Path(path) / MANIFEST).read_text()), wanted)


def load_tokenized(path: str | Path, wanted: dict[str, Any] | None) -> tuple[Any, Any]:
    """(train, eval or None) from ``path``; ``wanted`` None skips the comparison (no dataset configured)."""
    from datasets import load_from_disk

    folder = Path(path)
    saved = json.loads((folder / MANIFEST).read_text())
    if wanted is not None:
        changed = differences(saved, wanted)
        if changed:
            raise DataError(f"tokenized_path {folder} was prepared from other inputs ({'; '.join(changed)}); "
                            "set overwrite_cache: true to rebuild it, or point tokenized_path elsewhere")
    splits = load_from_disk(str(folder))
    return splits["train"], splits["eval"] if "eval" in splits else None


def save_tokenized(path: str | Path, train: Any, evaluation: Any, key: dict[str, Any]) -> None:
    """Write atomically: a temporary sibling folder, renamed over the old one only when complete."""
    from datasets import DatasetDict

    folder = Path(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    splits = {"train": train} | ({"eval": evaluation} if evaluation is not None else {})
    DatasetDict(splits).save_to_disk(str(temporary))
    (temporary / MANIFEST).write_text(json.dumps(key, indent=2))
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(folder, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(temporary, folder)
