"""DDP's buffer-sync switch follows the installed torch: the GPU machines run torch 2.11, which has no
``forward_sync_buffers`` (a DDP run there failed at wrap with "unexpected keyword argument")."""

from __future__ import annotations

import inspect

import torch

import shardtune.engines.ddp as ddp


def test_this_torch_takes_the_keyword_chosen():
    kwargs = ddp.no_forward_buffer_sync()
    module = torch.nn.Linear(2, 2)
    # The keyword must exist in the installed DDP's signature: binding it (without a process group) must not fail.
    inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).bind(None, module, **kwargs)


def test_a_torch_without_forward_sync_buffers_gets_broadcast_buffers(monkeypatch):
    class OlderDDP:  # torch 2.11's keywords
        def __init__(self, module, device_ids=None, broadcast_buffers=True, gradient_as_bucket_view=False):
            pass

    monkeypatch.setattr(ddp, "DistributedDataParallel", OlderDDP)
    assert ddp.no_forward_buffer_sync() == {"broadcast_buffers": False}


def test_a_torch_with_it_gets_forward_sync_buffers(monkeypatch):
    class NewerDDP:
        def __init__(self, module, broadcast_buffers=None, forward_sync_buffers=None):
            pass

    monkeypatch.setattr(ddp, "DistributedDataParallel", NewerDDP)
    assert ddp.no_forward_buffer_sync() == {"forward_sync_buffers": False}
