"""What the installed stack is, and every behaviour that differs inside the version ranges pyproject.toml declares.

A user's cluster brings its own torch (a CUDA build chosen for its driver) and often its own transformers; shardtune
meets them inside the declared ranges (docs/development.md: what decided each bound). Each place where the code must
ask which version it runs on asks here, so the differences are listed in one file and each branch has a unit test
(tests/unit/test_versions.py) that pretends to be the other version. Callers outside pass the objects they probe
(DDP's class, torch.distributed) so a test can hand in a stand-in; nothing here imports torch at module level
(``check`` and ``--help`` stay cheap).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
from collections.abc import Callable
from typing import Any


def installed_version(name: str) -> str | None:
    """The installed distribution's version from its metadata (no import: importing torch takes seconds), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str | None) -> tuple[int, ...]:
    """The leading numbers of a version: ``"2.11.0+cu128"`` -> (2, 11, 0); ``"2.10.0a0"`` -> (2, 10, 0); None or no
    number -> ()."""
    found = re.match(r"\d+(?:\.\d+)*", version or "")
    return tuple(int(part) for part in found[0].split(".")) if found else ()


def torch_at_least(*wanted: int) -> bool:
    """Whether the installed torch is at least ``wanted`` (e.g. 2, 10); False without torch."""
    return release(installed_version("torch"))[:len(wanted)] >= wanted


# ---- torch ----

def ddp_no_forward_buffer_sync(ddp_class: Callable[..., Any]) -> dict[str, Any]:
    """DDP's switch for the buffer broadcast before each forward, as ``ddp_class`` names it: torch 2.13 added
    ``forward_sync_buffers`` and deprecated ``broadcast_buffers``; earlier versions (2.11 on the GPU machines seen)
    know only ``broadcast_buffers``, which also leaves buffers out of the initial sync: harmless for shardtune, as
    every rank builds the same constant buffers."""
    if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


VARLEN_ATTN_SINCE = (2, 10)


def varlen_attn_available() -> bool:
    """torch.nn.attention.varlen (torch 2.10 and later), read from the version, not by importing torch."""
    return torch_at_least(*VARLEN_ATTN_SINCE)


@functools.cache
def varlen_attn_keywords() -> frozenset[str]:
    """The keywords the installed torch's ``varlen_attn`` takes: it gained sliding windows, a scale and GQA after its
    first release (torch 2.10); model/varlen.py's ``kernel_arguments`` does on the inputs what a keyword lacks."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


# torch 2.13 renamed ZeRO's two sharding collectives; the old names still work but warn on every call.
RENAMED_COLLECTIVES = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}


def current_collectives(dist: Any) -> dict[str, Callable[..., Any]]:
    """Old name -> the function under its current name, for each collective ``dist`` (torch.distributed) has
    renamed; empty on a torch that has only the old names."""
    return {old: getattr(dist, new) for old, new in RENAMED_COLLECTIVES.items() if hasattr(dist, new)}
