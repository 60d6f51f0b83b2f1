"""What sequence parallelism (``sequence_parallel_size`` N > 1) needs, decided on the launching host before any rank
starts: the kernels, models and layouts it is built for (every stage splits: sft and pt in the loop's token loss,
dpo/kto/rm in train/preference_step.py and train/reward.py), the mode ``auto`` becomes, the size a DeepSpeed JSON
asks for, and the dry run's line. Pure: it reads config.json files, never torch (the split itself is
engines/sequence_parallel.py, which runs on the ranks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from shardtune.config.schema import TrainConfig
from shardtune.errors import ConfigError, ModelError
from shardtune.model.folder import model_config_json
from shardtune.world import WorldLayout

FIX = "set sequence_parallel_size: 1"


def head_counts(model_config: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """(attention heads, KV heads) of a config.json (a multimodal one's text model); KV heads default to the heads.
    None when the config does not say."""
    config = (model_config or {}).get("text_config") or model_config or {}
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return None
    return heads, kv_heads


def resolved_mode(mode: str, model_config: Mapping[str, Any] | None, size: int) -> str:
    """The mode the ranks run: ``auto`` is ulysses when the heads and KV heads divide by ``size``, else allgather
    (the rule of engines/sequence_parallel.py ``resolve_mode``); ``auto`` stays when the heads are not known here."""
    if mode != "auto":
        return mode
    counts = head_counts(model_config)
    if counts is None:
        return "auto"
    return "ulysses" if all(count % size == 0 for count in counts) else "allgather"


def sequence_parallel_problems(c: TrainConfig, layout: WorldLayout | None = None) -> list[str]:
    """Why this run cannot split its sequences over ``c.sequence_parallel_size`` ranks, one line each naming the key
    and the fix (empty with N = 1). ``layout``: the world's rules too (None while the world size is unknown).
    Every attention kernel splits: the split attention runs sdpa per segment, and flash_attention_2 there is sdpa's
    flash backend, FlashAttention-2 inside torch, on the rank's CUDA GPU (train/setup.py ``loaded_kernel``)."""
    n = c.sequence_parallel_size
    if n == 1:
        return []
    key = f"sequence_parallel_size ({n})"
    problems = []
    if c.do_predict:
        problems.append(f"do_predict (true) with {key}: generation runs whole sequences on each rank and is not "
                        f"split; predict in a run of its own with sequence_parallel_size: 1")
    if c.cutoff_len < n:
        problems.append(f"cutoff_len ({c.cutoff_len}) is below {key}: a rank would hold less than one token of a "
                        "sequence; raise cutoff_len or lower sequence_parallel_size")
    problems += model_problems(c) + image_data_problems(c)
    if layout is not None:
        problems += layout.sequence_parallel_problems()
    return problems


def model_problems(c: TrainConfig) -> list[str]:
    """What of the model, and of a preference run's ``ref_model`` (its forwards are split too), the split cannot run
    (their config.json, where this machine has them)."""
    models = dict.fromkeys(m for m in (c.model_name_or_path, c.ref_model) if m)
    return [problem for model in models for problem in one_model_problems(c, model)]


def image_data_problems(c: TrainConfig) -> list[str]:
    """The datasets whose images the split cannot run (data/images.py ``NOT_SPLIT``), from dataset_info.json's
    columns (a v1 dataset file's image parts are found on the rank, by the image collator)."""
    from shardtune.data.images import NOT_SPLIT
    from shardtune.data.registry import load_registry

    names = dict.fromkeys([*c.dataset, *c.eval_dataset])
    if not names:
        return []
    registry, _ = load_registry(c.dataset_dir)  # an unreadable registry is the data checks' to name
    entries = {name: registry.get(name) for name in names}
    return [f"dataset '{name}' has images (columns.images), which sequence_parallel_size ({c.sequence_parallel_size}) "
            f"does not split ({NOT_SPLIT}); {FIX}"
            for name, entry in entries.items() if isinstance(entry, dict) and "images" in (entry.get("columns") or {})]


def one_model_problems(c: TrainConfig, model: str) -> list[str]:
    """What of ``model`` (a folder or hub id) the split cannot run."""
    from shardtune.model.attention import kernel_support, stateful_layer_kinds

    n = c.sequence_parallel_size
    try:
        config = model_config_json(model)
    except ModelError:
        return []  # reported by the folder checks
    if config is None:
        return []
    problems = []
    counts = head_counts(config)
    if c.sequence_parallel_mode == "ulysses" and counts is not None and any(count % n for count in counts):
        problems.append(f"sequence_parallel_mode (ulysses): {model} has {counts[0]} attention heads and {counts[1]} "
                        f"KV heads, which must both divide by sequence_parallel_size ({n}); use "
                        "sequence_parallel_mode: allgather (any head count) or auto")
    stateful = stateful_layer_kinds(config)
    if stateful:
        problems.append(f"sequence_parallel_size ({n}): {model} has {', '.join(stateful)} layers, whose state runs "
                        f"along the whole sequence and cannot be split over ranks; {FIX}")
    text = config.get("text_config") or config
    support = kernel_support(config)
    if (support is not None and support.sinks) or text.get("attn_logit_softcapping"):
        problems.append(f"sequence_parallel_size ({n}): {model}'s attention uses attention sinks or soft-capping, "
                        f"which the split attention (sdpa) does not compute; {FIX}")
    return problems


def with_deepspeed_sequence_parallel(c: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """The config with the size a DeepSpeed JSON's own ``sequence_parallel_size`` asks for (DeepSpeed never sees
    the key: ``resolve_deepspeed_config`` drops it), and the problems of that key. A JSON that cannot be read is
    left to the engine plan's problems."""
    from shardtune.engines.deepspeed_config import load_deepspeed_setting, sequence_parallel_in

    if not c.deepspeed:
        return c, []
    try:
        raw, source = load_deepspeed_setting(c.deepspeed)
    except ConfigError:
        return c, []
    size, problems = sequence_parallel_in(raw, source, c.sequence_parallel_size)
    return (replace(c, sequence_parallel_size=size) if size != c.sequence_parallel_size else c), problems


def describe_sequence_parallel(c: TrainConfig, layout: WorldLayout) -> str | None:
    """The dry run's line for a split run (None without one)."""
    n = layout.sequence_parallel
    if n == 1:
        return None
    try:
        config = model_config_json(c.model_name_or_path)
    except ModelError:
        config = None
    mode = resolved_mode(c.sequence_parallel_mode, config, n)
    if mode == "auto":
        mode = "auto, decided on each rank from the model's heads"
    elif c.sequence_parallel_mode == "auto":
        mode = f"auto: {mode}"
    return (f"sequence parallel: {n} ranks per sequence (mode {mode}) x data parallel: "
            f"{layout.data_parallel_size}")
