"""Checkpoint files read without running code a tampered file could carry.

DeepSpeed loads its own files with ``weights_only=False`` (its checkpoint engine, the ZeRO-3 and universal
readers, ``zero_to_fp32``, ``ds_to_universal``), which would run any code a tampered checkpoint carries. Its
files hold only tensors, plain containers and a few small record classes, so inside ``weights_only_loads()``
every ``torch.load`` is forced to ``weights_only=True`` with exactly those classes allowed. A file holding
anything else fails to load with torch's "Unsupported global" error instead of executing it. Calls that name no
``map_location`` load onto the CPU, not onto the device that wrote the file.

``python -m shardtune.engines.safe_load MODULE ARGS...`` runs a DeepSpeed command-line module the same way.

torch distributed checkpoints (FSDP's ``fsdp_state/``): torch reads their ``.metadata`` index with a plain
``pickle.load`` and their non-tensor values (optimizer hyper-parameters) with ``torch.load(weights_only=False)``.
``load_dcp_weights_only`` reads the index with an unpickler that only builds torch's checkpoint-metadata
classes, and the values with ``weights_only=True``; the tensor data itself torch already reads that way.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import runpy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardtune.errors import ModelError

# An entry of torch.serialization.safe_globals: a class or function, optionally with the name it was pickled under.
SafeGlobal = Callable[..., Any] | tuple[Callable[..., Any], str]


def deepspeed_record_classes() -> list[SafeGlobal]:
    """The non-tensor classes DeepSpeed pickles into its checkpoint files (DeepSpeed 0.19).

    The optimizer's state holds its loss scaler object itself: a static ``LossScaler`` under bf16 and fp32, a
    ``DynamicLossScaler`` under fp16 with dynamic scaling (DeepSpeed's default, ``loss_scale: 0``).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    original = torch.load
    allowed = deepspeed_record_classes()

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        if len(args) < 2:
            kwargs.setdefault("map_location", "cpu")  # never onto the GPU that wrote the file
        with torch.serialization.safe_globals(allowed):
            return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


# What a torch 2.13 ``.metadata`` file builds: the checkpoint's index (tensor sizes, dtypes, file offsets).
DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name such as "torch.strided" to the layout
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
})


class DcpMetadataUnpickler(pickle.Unpickler):
    """Builds only the classes in ``DCP_METADATA_GLOBALS`` and torch dtypes; anything else is refused."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype pickles as its name in the torch module
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise ModelError(f"checkpoint {self.source} refers to {module}.{name}, which a torch distributed "
                         "checkpoint's metadata never holds; refusing to unpickle it (a tampered or foreign file?)")


class WeightsOnlyDcpReader(FileSystemReader):
    """A torch distributed checkpoint folder whose ``.metadata`` index is read by ``DcpMetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = DcpMetadataUnpickler(stream, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise ModelError(f"checkpoint {path} holds a {type(metadata).__name__}, not torch checkpoint metadata")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id  # as the parent does
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """torch's default planner, except that non-tensor values load with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            reason = next((line.strip() for line in str(err).splitlines() if "Unsupported global" in line), "")
            raise ModelError(f"checkpoint value {read_item.dest_index.fqn} is not plain data, refusing to "
                             f"unpickle it ({reason or 'not loadable with weights_only=True'})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_dcp_weights_only(state: dict[str, Any], path: Path) -> None:
    """``torch.distributed.checkpoint.load`` into ``state`` (in place) without a full unpickle of any file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = WeightsOnlyDcpReader(str(path))
    if (Path(path) / ".metadata").is_file():
        reader.read_metadata()  # a refusal surfaces here as itself; inside dcp.load it becomes an assertion's text
    try:
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
    except CheckpointException as failure:  # torch gathers every rank's error into one exception
        refusals = [exc for exc, _ in failure.failures.values() if isinstance(exc, ModelError)]
        if refusals:
            raise refusals[0] from None
        raise


def main(argv: list[str]) -> int:
    module, *args = argv
    sys.argv = [module, *args]
    with weights_only_loads():
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
