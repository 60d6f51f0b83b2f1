"""Cache keys for our ``Dataset.map``/``filter`` steps.

datasets names a step's cache file after a hash of its inputs, but it pickles an importable
function by reference (module and name), not by code. After an upgrade of shardtune that changes
tokenisation, a rerun on the same files would silently load the old cached result. Every step
therefore gets a fingerprint that also covers the source of this package.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from datasets import Dataset
from datasets.fingerprint import Hasher


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """Digest of every module of ``shardtune.data``."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def step_fingerprint(dataset: Dataset, step: str, function: Any) -> str:
    """Fingerprint of applying ``function`` (with its bound arguments) to ``dataset`` in ``step``."""
    # _fingerprint is the parent's cache key; datasets exposes no public accessor for it.
    return Hasher.hash([dataset._fingerprint, source_digest(), step, function])
