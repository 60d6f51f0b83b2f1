"""OFT's adapters on a model shape: the widths it rotates and the parameters it trains (LoRA's are in shape.py).

The same arithmetic as model/oft.py, on config.json's numbers instead of a built model, so that the estimate and
the launching host's checks see what the ranks will build.
"""

from __future__ import annotations

from shardtune.estimate.shape import ModelShape, lora_target_modules
from shardtune.model.oft import OftSettings, trainable_params


def adapted_widths(shape: ModelShape, targets: tuple[str, ...] | list[str], index: int | None = None) -> dict[str, int]:
    """in_features of each targeted Linear layer of decoder layer ``index`` (the last by default), by name."""
    present = shape.layer_linear_shapes(index)
    return {name: present[name][0] for name in lora_target_modules(targets, shape) if name in present}


def all_adapted_widths(shape: ModelShape, targets: tuple[str, ...] | list[str]) -> dict[str, int]:
    """in_features of every targeted Linear layer name over the decoder layers (dense and MoE layers differ)."""
    found: dict[str, int] = {}
    for index in range(shape.num_layers):
        for name, width in adapted_widths(shape, targets, index).items():
            if found.setdefault(name, width) != width:
                found.setdefault(f"{name} (layer {index})", width)
    return found


def oft_params(shape: ModelShape, settings: OftSettings, targets: tuple[str, ...] | list[str]) -> int:
    """Trainable OFT parameters: in x (b - 1) / 2 per adapted Linear layer of in_features ``in`` and block size b."""
    return sum(trainable_params(width, settings) for index in range(shape.num_layers)
               for width in adapted_widths(shape, targets, index).values())
