"""Image-text checkpoints fine-tuned as downloaded: the class that loads a folder, and the parts of that class.

A Qwen3.5, Llama 4 or Mistral 3 folder holds a vision tower beside its language model. transformers' causal-LM
table maps some of these model types to a text-only class (``Qwen3_5ForCausalLM``), which drops the tower on load
and saves a folder of another class; others (``mistral3``, ``qwen3_vl``) have no causal-LM class at all. A folder
whose config carries a vision tower is therefore loaded with the class ``AutoModelForImageTextToText`` builds for
it, on every loading path, and saved as that class.

The parts follow LLaMA-Factory's keys: ``freeze_vision_tower`` and ``freeze_multi_modal_projector`` (both true by
default) and ``freeze_language_model``. They are found from the model itself, not from a table of names: a tower
is the outermost module holding the tower's own sub-config (``vision_config``), the language model the outermost
module holding ``text_config`` plus the output layer, and the projector whatever connects them (modules outside
both, and the mergers that some towers keep inside: Qwen's ``visual.merger``). Which parts stay frozen in training:
model/finetuning/image_text.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

IMAGE_TEXT_TABLE = "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"
TOWER_CONFIGS = ("vision_config", "audio_config")
# Children of a tower that project its features into the language model's width (LLaMA-Factory counts them as the
# projector): Qwen2-VL .. Qwen3.5's merger, Qwen3-VL's per-depth mergers.
TOWER_MERGERS = ("merger", "deepstack_merger_list")


def image_text_class_name(config: Mapping[str, Any]) -> str | None:
    """The class ``AutoModelForImageTextToText`` builds for this config.json when the folder is an image-text
    checkpoint (a vision tower in its config, or no text-only class for its type); None for a text model. Read
    from transformers' tables without importing it (``shardtune check``)."""
    from shardtune.model.transformers_tables import causal_lm_class_name, table

    model_type = str(config.get("model_type"))
    name = table(IMAGE_TEXT_TABLE).get(model_type)
    if not name or "auto_map" in config:
        return None
    has_tower = any(config.get(key) is not None for key in TOWER_CONFIGS)
    return name if has_tower or causal_lm_class_name(model_type) is None else None


def is_image_text(config: Any) -> bool:
    """``image_text_class_name`` for a loaded config object."""
    return image_text_class_name(config.to_dict()) is not None


def auto_model_class(config: Any) -> Any:
    """The transformers auto class that builds the model of ``config`` as its folder holds it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM


@dataclass(frozen=True)
class ModelParts:
    """Module names of an image-text model's parts (outermost modules; a part may hold several)."""

    towers: tuple[str, ...]
    projector: tuple[str, ...]
    language: tuple[str, ...]

    def part_of(self, name: str) -> str:
        """'tower', 'projector' or 'language' for a parameter or module name. Outside the towers and the language
        model is the projector; a model whose language layers hold the whole config (GIT) has no such module, and
        everything outside its towers is the language model."""
        if _under(name, self.projector):
            return "projector"
        if _under(name, self.towers):
            return "tower"
        return "language" if not self.language or _under(name, self.language) else "projector"


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def model_parts(model: Any) -> ModelParts | None:
    """The parts of an image-text model (None for a text model, or one without a tower: Mistral 4's text class).
    Works on a peft-wrapped model too (its names)."""
    config = getattr(model, "config", None)
    if config is None or not is_image_text(config):
        return None
    towers = {id(c) for key in TOWER_CONFIGS if (c := getattr(config, key, None)) is not None}
    text = config.get_text_config()
    found: dict[str, list[str]] = {"tower": [], "language": [], "merger": []}
    for name, module in model.named_modules():
        if not name or any(_under(name, tuple(names)) for names in found.values()):
            continue
        own = getattr(module, "config", None)
        if id(own) in towers:
            found["tower"].append(name)
            found["merger"] += [f"{name}.{child}" for child in TOWER_MERGERS if hasattr(module, child)]
        elif own is text and own is not config:
            found["language"].append(name)
    if not found["tower"]:
        return None
    output = model.get_output_embeddings()
    if found["language"] and output is not None:
        found["language"] += [name for name, module in model.named_modules() if module is output]
    return ModelParts(tuple(found["tower"]), tuple(found["merger"]), tuple(found["language"]))

