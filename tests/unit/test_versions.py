"""shardtune.versions: each behaviour that differs inside the declared version ranges, one test per branch (the
other version is a stand-in: a class with the older keywords, a torch.distributed without the new names, a
monkeypatched version string)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from shardtune import versions


def test_installed_version_reads_metadata_and_says_none_when_missing() -> None:
    assert versions.installed_version("torch") == torch.__version__.split("+")[0] or torch.__version__
    assert versions.installed_version("no-such-distribution-here") is None


@pytest.mark.parametrize(("text", "expected"), [
    ("2.11.0+cu128", (2, 11, 0)), ("2.10.0a0+git1234", (2, 10, 0)), ("5.0.0rc1", (5, 0, 0)), ("0.17.1", (0, 17, 1)),
    (None, ()), ("unknown", ()),
])
def test_release_keeps_the_leading_numbers(text: str | None, expected: tuple[int, ...]) -> None:
    assert versions.release(text) == expected


@pytest.mark.parametrize(("installed", "available"), [
    ("2.9.1+cu128", False), ("2.10.0", True), ("2.11.0+cu126", True), ("2.13.0+cpu", True), (None, False),
])
def test_varlen_attn_needs_torch_2_10(monkeypatch, installed: str | None, available: bool) -> None:
    monkeypatch.setattr(versions, "installed_version", lambda name: installed if name == "torch" else None)
    assert versions.varlen_attn_available() is available


def test_this_torch_takes_the_ddp_keyword_chosen() -> None:
    kwargs = versions.ddp_no_forward_buffer_sync(torch.nn.parallel.DistributedDataParallel)
    # The keyword must exist in the installed DDP's signature: binding it (without a process group) must not fail.
    inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).bind(None, torch.nn.Linear(2, 2), **kwargs)


def test_a_torch_without_forward_sync_buffers_gets_broadcast_buffers() -> None:
    class OlderDDP:  # torch 2.11's keywords (a DDP run there failed at wrap with "unexpected keyword argument")
        def __init__(self, module, device_ids=None, broadcast_buffers=True, gradient_as_bucket_view=False):
            pass

    assert versions.ddp_no_forward_buffer_sync(OlderDDP) == {"broadcast_buffers": False}


def test_a_torch_with_forward_sync_buffers_gets_it() -> None:
    class NewerDDP:  # torch 2.13
        def __init__(self, module, broadcast_buffers=None, forward_sync_buffers=None):
            pass

    assert versions.ddp_no_forward_buffer_sync(NewerDDP) == {"forward_sync_buffers": False}


def test_a_torch_with_the_renamed_collectives_maps_the_old_names_to_them() -> None:
    def gather(*args): ...
    def scatter(*args): ...

    dist = SimpleNamespace(all_gather_into_tensor=None, reduce_scatter_tensor=None, all_gather_single=gather,
                           reduce_scatter_single=scatter)
    assert versions.current_collectives(dist) == {"all_gather_into_tensor": gather, "reduce_scatter_tensor": scatter}


def test_a_torch_with_only_the_old_collective_names_changes_nothing() -> None:
    dist = SimpleNamespace(all_gather_into_tensor=print, reduce_scatter_tensor=print)  # torch 2.12 and before
    assert versions.current_collectives(dist) == {}


def test_varlen_attn_keywords_are_the_installed_signature() -> None:
    if not versions.varlen_attn_available():
        pytest.skip("this torch has no varlen_attn")
    from torch.nn.attention.varlen import varlen_attn

    assert versions.varlen_attn_keywords() == frozenset(inspect.signature(varlen_attn).parameters)
