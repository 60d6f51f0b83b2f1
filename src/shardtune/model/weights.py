"""Read a model folder's weights one tensor (or one slice of a tensor) at a time.

Sharded engines fill a model whose parameters were never materialised in full: each tensor is read when it is
needed and dropped right after. The safetensors file is opened anew for every read, because its memory map would
otherwise keep every page read so far resident, and a process that has read the whole file then counts the whole
file in its resident memory (the very copy sharding is meant to avoid).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardtune.errors import ModelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class WeightsReader:
    """Where each tensor of a Hugging Face model folder lives, and reads that count the bytes they load."""

    folder: Path
    files: dict[str, Path]  # tensor name -> safetensors file
    bytes_read: int = field(default=0)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read_slice(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block of ``name`` that starts at ``offsets`` and has ``shape`` (only its bytes are read)."""
        from safetensors import safe_open

        index = tuple(slice(start, start + size) for start, size in zip(offsets, shape, strict=True))
        with safe_open(str(self.files[name]), framework="pt") as handle:
            tensor = handle.get_slice(name)[index] if index else handle.get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def open_weights(folder: str | Path) -> WeightsReader | None:
    """A reader for a local folder of safetensors weights; None when there is none (hub id, .bin weights)."""
    path = Path(folder)
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise ModelError(f"model_name_or_path: {path / INDEX_FILE} is not a valid safetensors index ({err}); "
                             "re-save the model with save_pretrained") from None
        return WeightsReader(path, {name: path / file for name, file in weight_map.items()})
    if (path / SINGLE_FILE).is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path / SINGLE_FILE), framework="pt") as handle:
                names = list(handle.keys())
        except (SafetensorError, OSError) as err:
            raise ModelError(f"model_name_or_path: cannot read {path / SINGLE_FILE}: {err}; the file is damaged "
                             "or truncated, save or download the model again") from None
        return WeightsReader(path, dict.fromkeys(names, path / SINGLE_FILE))
    return None
