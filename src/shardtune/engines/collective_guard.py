"""A check, for tests, that every collective gets tensors on the engine's device.

NCCL moves CUDA tensors only: a collective handed a host tensor fails on a GPU (or, worse, waits), while the
same code passes every CPU test over gloo. With the guard installed, each torch.distributed collective (also the
ones FSDP and DeepSpeed call) first compares its tensors' device with the engine's and raises, naming the
collective and both devices, when they differ. Tests can then run the engine with its device set apart from the
host, for example the meta device with ``execute=False`` (collectives are checked, not run), so a tensor that was
never moved to the engine's device is caught on a CPU machine too.

``backends`` models the process group itself: which tensor device types it has a backend for (from the backend
string the ranks would use, e.g. ``group_backends("nccl")`` -> cuda only). A collective on a tensor of another type
fails as it would on that group ("No backend type associated with device type cpu"), also when the tensor is where
the engine keeps it, such as FSDP2's shards offloaded to the host. The functional collectives DTensor runs
(clipping a sharded gradient norm, gathering a full state dict) are checked as well.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
               "isend", "irecv", "_all_gather_base", "_reduce_scatter_base")
# torch.distributed._functional_collectives: what DTensor calls to redistribute (module attributes, looked up on
# every call, so a wrapper installed here sees them).
FUNCTIONAL = ("all_reduce", "all_gather_single", "all_gather_tensor", "all_gather_inplace", "reduce_scatter_single",
              "reduce_scatter_tensor", "broadcast", "all_to_all_single")


class CollectiveDeviceError(RuntimeError):
    """A collective was given a tensor that is not on the engine's device."""


@dataclass
class CollectiveGuard:
    """Counts checked collectives; ``device`` is where every collective tensor must live."""

    device: torch.device
    execute: bool = True  # False: check only (a test whose engine device, such as meta, has no collectives)
    backends: dict[str, str] | None = None  # the group's backend per tensor device type; None: not checked
    checked: int = 0
    originals: dict[tuple[Any, str], Callable] = field(default_factory=dict)

    def check(self, name: str, args: tuple, kwargs: dict) -> None:
        for tensor in _tensors(list(args) + list(kwargs.values())):
            if self.backends is not None and tensor.device.type not in self.backends:
                raise CollectiveDeviceError(f"collective {name} got a tensor on {tensor.device} (shape "
                                            f"{tuple(tensor.shape)}): no backend type associated with device type "
                                            f"{tensor.device.type} in the process group ({_spelled(self.backends)})")
            if not _same_device(tensor.device, self.device):
                raise CollectiveDeviceError(f"collective {name} got a tensor on {tensor.device} (shape "
                                            f"{tuple(tensor.shape)}); the engine's device is {self.device}")
        self.checked += 1

    def install(self) -> CollectiveGuard:
        for module, names in ((dist, COLLECTIVES), (c10d, COLLECTIVES), (funcol, FUNCTIONAL)):
            for name in names:
                original = getattr(module, name, None)
                if original is None or (module, name) in self.originals:
                    continue
                self.originals[(module, name)] = original
                setattr(module, name, self._wrap(name, original))
        return self

    def uninstall(self) -> None:
        for (module, name), original in self.originals.items():
            setattr(module, name, original)
        self.originals.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def checked(*args: Any, **kwargs: Any) -> Any:
            self.check(name, args, kwargs)
            return original(*args, **kwargs) if self.execute else None

        return checked


def _spelled(backends: dict[str, str]) -> str:
    return ",".join(f"{device}:{name}" for device, name in backends.items()) or "no backends"


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    return expected.index is None or actual.index is None or actual.index == expected.index


def _tensors(values: list[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from _tensors(list(value))
