"""pissa_convert: save the trained PiSSA adapter also as a plain LoRA of the original model.

PiSSA starts the adapter from the principal singular vectors of each weight and removes them from the base
weight, so the trained adapter only makes sense on that rewritten (residual) base. peft converts it: with the
adapter as it was before training, ``B A - B0 A0`` is written as a LoRA of twice the rank that applies to the
original, unchanged base model. As LLaMA-Factory does: the initial adapter goes to ``output_dir/pissa_init`` when
training starts, the converted one to ``output_dir/pissa_converted`` when it ends; ``output_dir`` keeps the
PiSSA adapter itself. PiSSA is only built by replicating engines (one process, DDP, ZeRO-0/1/2), so the main
rank holds every adapter weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

INIT_DIR = "pissa_init"
CONVERTED_DIR = "pissa_converted"


@dataclass(frozen=True)
class PissaConversion:
    """Where the initial adapter was saved (main rank only writes)."""

    output_dir: Path

    @classmethod
    def start(cls, model: Any, output_dir: Path, is_main: bool) -> PissaConversion:
        """Save the adapter as initialised, before any step changes it."""
        conversion = cls(output_dir)
        if is_main:
            config = model.peft_config["default"]
            initialisation = config.init_lora_weights
            config.init_lora_weights = True  # loading the saved files must not run the SVD again
            try:
                model.save_pretrained(str(output_dir / INIT_DIR))
            finally:
                config.init_lora_weights = initialisation
        return conversion

    def save_converted(self, model: Any, is_main: bool) -> None:
        """Write the trained adapter as a plain LoRA relative to the original base weights."""
        if is_main:
            model.save_pretrained(str(self.output_dir / CONVERTED_DIR),
                                  path_initial_model_for_weight_conversion=str(self.output_dir / INIT_DIR))
