"""Whether the checkpoint a run resumes from can be read back by this run, decided before launch.

A checkpoint holds one engine's layout (``deepspeed/``, ``fsdp_state/``, ``trainable.safetensors``, ...) and
tensors shaped by the keys it was trained with (the model, the fine-tuning method, LoRA's rank and targets, the
optimizer). A run with another engine or other values would fail inside every rank while loading, with a shape
error; here it is one line naming what differs and the way out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardtune import run_files
from shardtune.config.schema import TrainConfig
from shardtune.engines.engine_plan import EnginePlan
from shardtune.engines.plan import ENGINE_SPECS, spec_for
from shardtune.model.folder import model_config_json
from shardtune.train.checkpoint_folders import MODEL_ONLY_MARKER

# Keys whose value decides which tensors a checkpoint holds and their shapes.
WEIGHT_KEYS = ("stage", "finetuning_type", "lora_rank", "lora_target", "oft_rank", "oft_block_size", "oft_target",
               "additional_target", "use_dora",
               "freeze_trainable_layers", "freeze_trainable_modules", "add_tokens", "add_special_tokens",
               "resize_vocab", "quantization_bit")
# Keys whose value decides the optimizer state's layout (not read from a model-only checkpoint).
OPTIMIZER_KEYS = ("optim", "use_muon", "use_adam_mini", "use_galore", "use_apollo", "use_badam")
# The model's config.json entries that fix every weight's shape.
MODEL_SHAPE = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "vocab_size")


def resume_read_problems(c: TrainConfig, plan: EnginePlan, checkpoint: Path, key: str) -> list[str]:
    """Why this run cannot read ``checkpoint`` back (empty when it can); ``key`` names the setting that chose it."""
    model_only = (checkpoint / MODEL_ONLY_MARKER).is_file()
    problems = [] if model_only else engine_layout_problems(plan, checkpoint, key)
    recorded = recorded_config(checkpoint)
    if recorded is None:
        return problems
    keys = WEIGHT_KEYS if model_only else WEIGHT_KEYS + OPTIMIZER_KEYS
    changed = [f"{name} {_shown(recorded.get(name))} then, {_shown(getattr(c, name))} now" for name in keys
               if name in recorded and _normal(recorded[name]) != _normal(getattr(c, name))]
    changed += model_shape_changes(recorded.get("model_name_or_path"), c.model_name_or_path)
    if changed:
        problems.append(f"{key}: {checkpoint} was trained with other settings ({'; '.join(changed)}), so its "
                        "tensors do not fit this run: use the checkpoint's values, or start afresh (another "
                        "output_dir, or overwrite_output_dir: true)")
    return problems


def engine_layout_problems(plan: EnginePlan, checkpoint: Path, key: str) -> list[str]:
    """A checkpoint written by another engine family than this run's."""
    accepted = spec_for(plan.kind).checkpoints
    if not accepted or any(layout.holds(checkpoint) for layout in accepted):
        return []
    written = [(spec.kind, layout) for spec in ENGINE_SPECS.values() for layout in spec.checkpoints
               if layout.holds(checkpoint)]
    if not written:
        return []
    kind, layout = written[0]
    return [f"{key}: {checkpoint} holds a {kind} checkpoint ({layout.marker}), and this run uses "
            f"{spec_for(plan.kind).describe(plan)}: resume with the engine settings that wrote it, or run `shardtune "
            f"export {checkpoint} --out DIR` and start a new run from DIR"]


def recorded_config(checkpoint: Path) -> dict[str, Any] | None:
    """The config the checkpoint was trained with: its own copy, else its run folder's (older checkpoints)."""
    for path in (checkpoint / run_files.RESOLVED_CONFIG, checkpoint.parent / run_files.RESOLVED_CONFIG):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        return data if isinstance(data, dict) and data else None
    return None


def model_shape_changes(then: Any, now: str | None) -> list[str]:
    """The model's shape entries that differ between the checkpoint's model and this run's (both readable)."""
    if not isinstance(then, str) or not now or then == now:
        return []
    try:
        before, after = model_config_json(then), model_config_json(now)
    except Exception:  # an unreadable model is the folder checks' to report
        return []
    if before is None or after is None:
        return []
    return [f"the model's {entry} {before.get(entry)} then ({then}), {after.get(entry)} now ({now})"
            for entry in MODEL_SHAPE if before.get(entry) != after.get(entry)]


def _normal(value: Any) -> Any:
    return sorted(value) if isinstance(value, list) else value


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)
