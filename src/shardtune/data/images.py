"""Images in sft samples: LLaMA-Factory's ``images`` column, read through the model's own image processor.

A record names its images (paths relative to dataset_dir) and marks where each one goes with ``<image>`` in its
turns, as LLaMA-Factory's ``mllm_demo`` does. The chat template renders the text; each marker becomes the tokens
that stand for one image in the family's layout (``ImageProcessor.image_ids``: one token per merged patch of the
grid the image processor, saved beside the weights, cuts the image into). The collator turns the kept image paths
into the pixel inputs of the batch (``VisionCollator``).

Every micro-batch of a run with images runs the vision tower, also one without images: a rank that skipped it would
skip the collectives ZeRO-3 and FSDP run inside it, and under DDP a trainable tower would miss gradients there. Such
a batch gets one blank image whose tokens are appended to its first row with no label: in a causal model no earlier
token attends to them, so no trained token's loss changes (tests/distributed/test_image_training.py checks 2
processes, one given only text, against 1). transformers' towers cannot run on zero patches (Qwen3-VL's position
interpolation fails on an empty grid), which would have been the exact way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune.data.settings import IGNORE_INDEX
from shardtune.errors import DataError

IMAGE_MARKER = "<image>"
BLANK_SIDE = 32  # the blank image's side in pixels; the processor scales it to its own bounds
# Why rows with images are not split over a sequence group: a rank's slice would need the whole row's multimodal
# positions (mRoPE) sliced, and its image tokens would not match the tower's features of every image in the batch.
NOT_SPLIT = "the model builds an image's positions and features from the whole row"


@dataclass(frozen=True)
class ImageLayout:
    """How a family writes one image into the token stream, as its processor does: the pieces ``before`` and
    ``after`` the run of image tokens (text, or ``@field``: the token id in that config field), how many image
    tokens (``count``: "grid", one per merged patch of the image's grid; "config", the config's fixed
    ``mm_tokens_per_image``; "processor", the image processor's ``num_soft_tokens_per_image``), and the model input
    that flags image tokens. ``tokens``: the config's token id fields and their tokens (for tiny models)."""

    before: tuple[str, ...]
    after: tuple[str, ...]
    count: str
    type_key: str
    tokens: Mapping[str, str]


_QWEN = ImageLayout(("@vision_start_token_id",), ("@vision_end_token_id",), "grid", "mm_token_type_ids",
                    {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                     "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"})
# Gemma 3's processor writes "\n\n<start_of_image>", the soft tokens, "<end_of_image>\n\n"; the model attends
# bidirectionally within an image, flagged by token_type_ids.
_GEMMA3 = ImageLayout(("\n\n", "@boi_token_id"), ("@eoi_token_id", "\n\n"), "config", "token_type_ids",
                      {"image_token_id": "<image_soft_token>", "boi_token_id": "<start_of_image>",
                       "eoi_token_id": "<end_of_image>"})
# Gemma 4: begin-of-image, as many soft tokens as the processor's budget gives the image's aspect ratio, end.
_GEMMA4 = ImageLayout(("@boi_token_id",), ("@eoi_token_id",), "processor", "mm_token_type_ids",
                      {"image_token_id": "<|image|>", "boi_token_id": "<|image>", "eoi_token_id": "<image|>"})
# Processor class (transformers' pairing for the model type) -> its image layout.
LAYOUTS = {"Qwen2VLProcessor": _QWEN, "Qwen2_5_VLProcessor": _QWEN, "Qwen3VLProcessor": _QWEN,
           "Gemma3Processor": _GEMMA3, "Gemma4Processor": _GEMMA4}
TYPE_KEYS = tuple(dict.fromkeys(layout.type_key for layout in LAYOUTS.values()))  # the per-token image flags
# The pixel inputs of a batch (not per row): Qwen's patches and grids, Gemma 4's padded patches and positions.
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_position_ids")


def supported_processors() -> str:
    return ", ".join(sorted({name.removesuffix("Processor") for name in LAYOUTS}))


def layout_of(model_type: str) -> ImageLayout | None:
    return LAYOUTS.get(processor_class_name(model_type) or "")


def processor_class_name(model_type: str) -> str | None:
    """The processor class transformers pairs with ``model_type`` (None when it has none)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    return PROCESSOR_MAPPING_NAMES.get(model_type)


def image_support_problem(model_type: str) -> str | None:
    """Why a model of ``model_type`` cannot train on images here (None when it can)."""
    name = processor_class_name(model_type)
    if name in LAYOUTS:
        return None
    if name is None:
        return (f"model type '{model_type}' has no image processor in transformers: it is a text-only model; use an "
                f"image-text checkpoint ({supported_processors()}) or remove the images column")
    return (f"images for model type '{model_type}' ({name}) are not read yet; shardtune trains images with "
            f"{supported_processors()} models")


@dataclass(frozen=True)
class ImageSettings:
    """LLaMA-Factory's image keys: the pixel bounds every image is scaled into (keeping its aspect ratio)."""

    max_pixels: int = 768 * 768
    min_pixels: int = 32 * 32


class ImageProcessor:
    """The model's image processor and image tokens, set up for training: expands image markers and builds pixel
    inputs (``ImageLayout`` says how the family writes an image).

    Only the image processor is loaded (preprocessor_config.json), not transformers' whole processor: that one
    also builds a video processor, which needs torchvision."""

    def __init__(self, image_processor: Any, tokenizer: Any, layout: ImageLayout, token_ids: Mapping[str, int],
                 settings: ImageSettings, tokens_per_image: int | None = None) -> None:
        self.image_processor = image_processor
        self.layout = layout
        self.image_token_id = token_ids["image_token_id"]
        self.tokens_per_image = tokens_per_image
        self.tokenizer = tokenizer
        self.before = self._piece_ids(layout.before, token_ids)
        self.after = self._piece_ids(layout.after, token_ids)
        # Bounds for processors that scale each image by its pixels (Qwen); Gemma's have their own size or budget.
        self.pixel_options = ({"size": {"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels}}
                              if layout.count == "grid" else {})
        self._blank: tuple[list[int], dict[str, Any]] | None = None

    def _piece_ids(self, pieces: tuple[str, ...], token_ids: Mapping[str, int]) -> list[int]:
        return [token for piece in pieces for token in
                ([token_ids[piece[1:]]] if piece.startswith("@")
                 else self.tokenizer(piece, add_special_tokens=False)["input_ids"])]

    def image_ids(self, pixels: Mapping[str, Any], index: int) -> list[int]:
        """The tokens that stand for image ``index`` of ``pixels``."""
        if self.layout.count == "grid":
            count = int(pixels["image_grid_thw"][index].prod()) // int(self.image_processor.merge_size) ** 2
        elif self.layout.count == "processor":
            count = int(pixels["num_soft_tokens_per_image"][index])
        else:
            count = int(self.tokens_per_image or 0)
        return self.before + [self.image_token_id] * count + self.after

    def encode_piece(self, text: str, images: Sequence[str]) -> list[int]:
        """Token ids of one prompt piece whose ``<image>`` markers stand for ``images`` (in order)."""
        pixels = self.pixel_inputs(images)
        parts = text.split(IMAGE_MARKER)
        encoded = self.tokenizer(parts, add_special_tokens=False)["input_ids"]
        ids = list(encoded[0])
        for index, part in enumerate(encoded[1:]):
            ids += self.image_ids(pixels, index) + list(part)
        return ids

    def pixel_inputs(self, paths: Sequence[str]) -> dict[str, Any]:
        """The model's pixel inputs (pixel_values, and image_grid_thw where the family has grids) for ``paths``."""
        return self.pixels(open_images(paths))

    def pixels(self, images: list[Any]) -> dict[str, Any]:
        """The image processor's output: the model's pixel inputs (``model_pixels``) and Gemma 4's token counts."""
        out = self.image_processor(images=images, return_tensors="pt", **self.pixel_options)
        return {key: out[key] for key in (*IMAGE_KEYS, "num_soft_tokens_per_image") if key in out}

    def type_ids(self, input_ids: Any) -> Any:
        """The model's per-token image flags (1 on image tokens)."""
        return (input_ids == self.image_token_id).long()

    def blank(self) -> tuple[list[int], dict[str, Any]]:
        """One blank image: the token ids that stand for it and its pixel inputs (see the module docstring)."""
        if self._blank is None:
            from PIL import Image

            pixels = self.pixels([Image.new("RGB", (BLANK_SIDE, BLANK_SIDE))])
            self._blank = self.image_ids(pixels, 0), pixels
        return self._blank


def model_pixels(pixels: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of an image processor's output that the model takes."""
    return {key: value for key, value in pixels.items() if key in IMAGE_KEYS}


def open_images(paths: Sequence[str]) -> list[Any]:
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"image {path}: cannot be read ({err}); fix or remove it") from None
    return images


def load_image_processor(model_dir: str, tokenizer: Any, settings: ImageSettings, trust_remote_code: bool = False
                         ) -> ImageProcessor:
    """The image processor saved beside the model (preprocessor_config.json), as transformers loads it, and the
    image token ids of the model's config."""
    from transformers import AutoConfig, AutoImageProcessor

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    layout = layout_of(config.model_type)
    if layout is None:
        raise DataError(f"images: {image_support_problem(config.model_type)}")
    try:
        image_processor = AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise DataError(f"images: the image processor of {model_dir} cannot be loaded ({err}); an image-text "
                        "checkpoint keeps preprocessor_config.json beside its weights") from None
    token_ids = {field: int(getattr(config, field)) for field in layout.tokens if hasattr(config, field)}
    return ImageProcessor(image_processor, tokenizer, layout, token_ids, settings,
                          getattr(config, "mm_tokens_per_image", None))


def blank_image_inputs(model_dir: str) -> dict[str, Any]:
    """One row of the blank image alone, as a batch: ``input_ids``, the image flags and its pixel inputs."""
    import torch
    from transformers import AutoTokenizer

    processor = load_image_processor(model_dir, AutoTokenizer.from_pretrained(model_dir), ImageSettings())
    ids, pixels = processor.blank()
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, processor.layout.type_key: processor.type_ids(input_ids), **model_pixels(pixels)}


def resolve_image_paths(value: Any, column: str, media_dir: Path) -> list[str]:
    """A record's images column as absolute paths (relative ones are under ``media_dir``), each an existing file."""
    if value is None:
        return []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"'{column}' must be a list of image paths, got {type(value).__name__}")
    paths = [Path(name) if Path(name).is_absolute() else media_dir / name for name in names]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise ValueError(f"'{column}': image {missing[0]} does not exist (paths are relative to dataset_dir)")
    return [str(path) for path in paths]


def marker_problem(messages: Sequence[Mapping[str, str]], images: Sequence[str]) -> str | None:
    """Why the ``<image>`` markers of a chat do not match its images (None when they do)."""
    answers = [message["content"] for message in messages if message["role"] not in ("user", "observation")]
    if any(IMAGE_MARKER in content for content in answers):
        return f"'{IMAGE_MARKER}' in an answer: images go in prompts (user turns)"
    markers = sum(message["content"].count(IMAGE_MARKER) for message in messages)
    if markers != len(images):
        return (f"{markers} '{IMAGE_MARKER}' markers for {len(images)} images: put one '{IMAGE_MARKER}' in the "
                "prompt where each image goes")
    return None


class VisionCollator:
    """A text collator's batch plus the pixel inputs of its rows' images (``images`` paths in each feature).

    Positions are left to the model, which builds multimodal ones (mRoPE) from ``mm_token_type_ids`` and the image
    grids; a batch without images gets the blank image (see the module docstring)."""

    def __init__(self, text_collator: Any, images: ImageProcessor) -> None:
        split = getattr(text_collator, "sequence_parallel", 1)
        if split > 1:  # the rank's guard: the launching host refuses it first (engines/sequence_parallel_plan.py)
            raise DataError(f"images: sequence_parallel_size ({split}) does not split rows with images ({NOT_SPLIT}); "
                            "set sequence_parallel_size: 1")
        self.text_collator = text_collator
        self.images = images

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, Any]:
        paths = [path for feature in features for path in feature.get("images") or []]
        rows = [{key: value for key, value in feature.items() if key != "images"} for feature in features]
        if paths:
            pixels = self.images.pixel_inputs(paths)
        else:
            blank_ids, pixels = self.images.blank()
            first = rows[0]
            rows[0] = {**first, "input_ids": list(first["input_ids"]) + blank_ids,
                       "labels": list(first["labels"]) + [IGNORE_INDEX] * len(blank_ids)}
        batch = self.text_collator(rows)
        batch.pop("position_ids", None)
        batch.update(model_pixels(pixels))
        batch[self.images.layout.type_key] = self.images.type_ids(batch["input_ids"])
        return batch


def image_inputs_of_rows(batch: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """The pixel inputs of the images in rows [start, stop) of a batch: images are in row order, a row's images are
    its runs of flagged image tokens, and each image has its grid's product of patches in ``pixel_values`` (one
    row each where the family has no grids)."""
    import torch

    flags = next(batch[key] for key in TYPE_KEYS if key in batch) == 1
    starts = flags & ~torch.cat([torch.zeros_like(flags[:, :1]), flags[:, :-1]], dim=1)
    per_row = starts.sum(dim=1).tolist()
    first, last = sum(per_row[:start]), sum(per_row[:stop])
    if "image_grid_thw" not in batch:  # one entry per image (Gemma 3's pixels, Gemma 4's padded patches)
        return {key: batch[key][first:last] for key in IMAGE_KEYS if key in batch}
    patches = [0, *batch["image_grid_thw"].prod(dim=-1).cumsum(0).tolist()]
    return {"pixel_values": batch["pixel_values"][patches[first]:patches[last]],
            "image_grid_thw": batch["image_grid_thw"][first:last]}
