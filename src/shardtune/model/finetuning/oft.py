"""OFT (orthogonal fine-tuning, peft's ``OFTConfig``): each adapted Linear layer rotates its input by a trained
block-diagonal orthogonal matrix before the frozen weight, so the weight's angles between neurons are kept.

A layer of ``in_features`` inputs gets ``r`` blocks of ``block_size`` (``r x block_size == in_features``); the user
gives one of the two (``oft_rank`` or ``oft_block_size``) and peft derives the other. Each block is stored as the
``b(b-1)/2`` entries of a skew-symmetric matrix turned orthogonal by the Cayley transform, zero at the start (the
identity rotation), so a new adapter leaves the model's output unchanged. peft silently rounds a size that does not
divide a layer's ``in_features`` to a near divisor; shardtune refuses it instead (``divisor_problems``), so the
trained adapter is the one the config describes. LoRA and OFT share everything around the adapter (targets, saving,
merging, resuming: model/finetuning/adapter.py); this module holds what is OFT's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardtune.errors import ConfigError


@dataclass(frozen=True)
class OftSettings:
    """LLaMA-Factory's OFT keys: ``oft_rank``, ``oft_block_size``, ``module_dropout``."""

    rank: int = 0
    block_size: int = 32
    module_dropout: float = 0.0


def size_problem(rank: int, block_size: int) -> str | None:
    """peft's rule: exactly one of ``r`` and ``oft_block_size`` is nonzero, since ``r x block size`` is fixed by each
    layer's in_features."""
    if rank == 0 and block_size == 0:
        return ("oft_rank (0) and oft_block_size (0): OFT needs one of them; set oft_block_size (e.g. 32, a divisor "
                "of the adapted layers' in_features) or oft_rank")
    if rank and block_size:
        return (f"oft_rank ({rank}) and oft_block_size ({block_size}) are both set: OFT takes one of them (oft_rank "
                "x oft_block_size = a layer's in_features); set oft_block_size: 0 to use oft_rank, or remove "
                "oft_rank")
    return None


def divisor_problems(in_features: dict[str, int], settings: OftSettings) -> list[str]:
    """Adapted layers (short name -> in_features) whose in_features the chosen size does not divide."""
    key, size = ("oft_block_size", settings.block_size) if settings.block_size else ("oft_rank", settings.rank)
    problems = []
    for name, width in sorted(in_features.items()):
        if size > width or width % size:
            problems.append(f"{key} ({size}) does not divide {name}'s in_features ({width}); use a divisor such as "
                            f"{_near_divisor(width, size)}, or leave {name} out of oft_target")
    return problems


def _near_divisor(width: int, size: int) -> int:
    divisors = [d for d in range(1, width + 1) if width % d == 0]
    return min(divisors, key=lambda d: (abs(d - size), d))


def block_size_of(in_features: int, settings: OftSettings) -> int:
    """The block size a layer of ``in_features`` inputs gets (its size divides, ``divisor_problems`` saw to it)."""
    return settings.block_size or in_features // settings.rank


def trainable_params(in_features: int, settings: OftSettings) -> int:
    """Parameters OFT trains on one Linear layer: (in / b) blocks of b(b-1)/2 entries each."""
    block = block_size_of(in_features, settings)
    return in_features // block * (block * (block - 1) // 2)


def build_oft_config(settings: OftSettings, modules: Any, *, exclude: list[str] | None,
                     modules_to_save: list[str] | None, task_type: str) -> Any:
    """peft's OFTConfig for a new adapter on ``modules`` (peft's ``target_modules``: names or "all-linear")."""
    from peft import OFTConfig

    problem = size_problem(settings.rank, settings.block_size)
    if problem:
        raise ConfigError(problem)
    return OFTConfig(task_type=task_type, r=settings.rank, oft_block_size=settings.block_size,
                     module_dropout=settings.module_dropout, target_modules=modules, exclude_modules=exclude,
                     modules_to_save=modules_to_save)


def adapted_in_features(model: Any) -> dict[str, int]:
    """Short name -> in_features of the Linear layers an OFT adapter wraps (one width per name: a name of several
    widths, as a vision tower and a language model may have, is kept under its first)."""
    from peft.tuners.oft import OFTLayer

    found: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, OFTLayer) and module.oft_R:
            found.setdefault(name.rsplit(".", 1)[-1], module.in_features)
    return found


def check_adapted_sizes(model: Any, settings: OftSettings) -> None:
    """Refuse the sizes peft would have rounded (on the ranks; the launching host checks config.json first)."""
    problems = divisor_problems(adapted_in_features(model), settings)
    if problems:
        raise ConfigError(*problems)


def materialize_oft_weights(model: Any) -> None:
    """Give every OFT block real host tensors: zero rotations and the index buffers of the upper triangle.

    peft places a new adapter on its base layer's device; a sharding engine builds the base on the meta device,
    where the (zero) rotations and peft's index buffers would have no values. They are computed, not drawn, so
    both the whole and the empty build start from the same adapter.
    """
    import torch
    from peft.tuners.oft import OFTLayer

    for module in model.modules():
        if not isinstance(module, OFTLayer):
            continue
        for adapter, rotation in module.oft_R.items():
            if not any(t.is_meta for t in [*rotation.parameters(), *rotation.buffers()]):
                continue
            rotation.to_empty(device="cpu")
            size = int(module.oft_block_size[adapter])
            rows, cols = torch.triu_indices(size, size, 1)
            rotation.rows, rotation.cols = rows, cols
            module.reset_oft_parameters(adapter, init_weights=True)
