"""The settings the data layer needs, independent of how the config file is laid out."""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("sft", "pt")
IGNORE_INDEX = -100  # label value that the loss skips (transformers' convention)


@dataclass(frozen=True)
class DataSettings:
    """Which datasets to load and how to turn them into token ids.

    ``dataset`` names entries of ``<dataset_dir>/dataset_info.json``; several are concatenated.
    ``val_size`` below 1 is a fraction of the samples held out for evaluation, 1 or more a count.
    ``packing`` puts several whole samples into one row of at most ``cutoff_len`` tokens (sft),
    or concatenates texts into ``cutoff_len`` blocks (pt).
    """

    dataset: tuple[str, ...]
    dataset_dir: str = "data"
    template: str = "default"
    default_system: str | None = None
    enable_thinking: bool = True
    tool_format: str | None = None
    stage: str = "sft"
    cutoff_len: int = 1024
    max_samples: int | None = None
    val_size: float = 0.0
    packing: bool = False
    train_on_prompt: bool = False
    seed: int = 42
    preprocessing_num_workers: int | None = None
    overwrite_cache: bool = False


def dataset_names(settings: DataSettings) -> list[str]:
    """The dataset names, also accepting LLaMA-Factory's comma-separated string form."""
    raw = settings.dataset
    parts = raw.split(",") if isinstance(raw, str) else list(raw)
    return [name.strip() for name in parts if name.strip()]
