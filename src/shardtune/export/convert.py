"""Turn any checkpoint or final output into a plain Hugging Face model folder, in one process.

Sources: a final output_dir (full model or LoRA adapter) or a ``checkpoint-<step>`` folder written by any engine
(local/DDP ``trainable.safetensors``, FSDP sharded ``fsdp_state/`` or ``fsdp_full_state.pt``, DeepSpeed ZeRO
``deepspeed/``). The number of processes that wrote it does not matter: sharded states are gathered here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeGuard

import torch

from shardtune import run_files
from shardtune.config.adapter_method import is_adapter_type, target_key
from shardtune.engines.replicated import WEIGHTS_FILE
from shardtune.engines.spec import CheckpointLayout
from shardtune.errors import ModelError
from shardtune.export.destination import check_destination, staged_folder
from shardtune.export.serving import ServingSettings, finish_servable, resolve_save_dtype, settings_from_run
from shardtune.model.folder import is_reward_model_config
from shardtune.model.reward_head import RewardHead, to_reward_model

RUN_CONFIG = run_files.RESOLVED_CONFIG


def find_run_config(source: Path) -> dict[str, Any]:
    """The resolved config of the run that wrote ``source`` (beside it, or in its output_dir)."""
    for folder in (source, source.parent):
        path = folder / RUN_CONFIG
        if path.is_file():
            return json.loads(path.read_text())
    raise ModelError(f"export: no {RUN_CONFIG} in {source} or its parent; pass --model BASE_MODEL_DIR and "
                     "--finetuning-type to say what was trained")


def checkpoint_kind(source: Path) -> str:
    """Which layout ``source`` holds: an engine's checkpoint (from the engines' records), or a final output."""
    for layout in checkpoint_layouts():
        if layout.holds(source):
            return layout.name
    if (source / "adapter_model.safetensors").is_file():
        return "adapter"
    if (source / "model.safetensors").is_file() or (source / "model.safetensors.index.json").is_file():
        return "model"
    markers = ", ".join(layout.marker for layout in checkpoint_layouts())
    raise ModelError(f"export: {source} holds no checkpoint shardtune knows (no {markers}, "
                     "adapter_model.safetensors or model.safetensors)")


def checkpoint_layouts() -> list[CheckpointLayout]:
    from shardtune.engines.plan import ENGINE_SPECS

    return list({layout.name: layout for spec in ENGINE_SPECS.values() for layout in spec.checkpoints}.values())


class MergesAdapter(Protocol):
    """A peft model with LoRA layers (peft forwards ``merge_and_unload`` to its LoRA model)."""

    def merge_and_unload(self) -> torch.nn.Module: ...


def merges_adapter(model: object) -> TypeGuard[MergesAdapter]:
    # hasattr, not a runtime_checkable isinstance: from Python 3.12 that skips peft's forwarding __getattr__.
    return hasattr(model, "merge_and_unload")


def build_trained_model(base: str, finetuning: dict[str, Any], reward: RewardHead | None) -> torch.nn.Module:
    """The model structure that was trained: base weights (under the score head of a reward model), plus the
    adapter's modules when LoRA or OFT was used; under freeze, the layers that trained are the trainable ones."""
    from shardtune.model.finetuning.apply import apply_finetuning
    from shardtune.model.finetuning.oft import OftSettings
    from shardtune.model.finetuning.settings import FinetuningSettings
    from shardtune.model.load import load_causal_lm

    model = load_causal_lm(base)
    if reward is not None:
        model = to_reward_model(model, reward)
    if finetuning.get("finetuning_type") == "freeze":  # the checkpoint holds the trained layers only
        return apply_finetuning(model, FinetuningSettings(
            finetuning_type="freeze", freeze_trainable_layers=int(finetuning.get("freeze_trainable_layers", 2)),
            freeze_trainable_modules=tuple(finetuning.get("freeze_trainable_modules") or ("all",)),
            score_head=reward is not None))
    method = finetuning.get("finetuning_type")
    if not is_adapter_type(method):
        return model
    settings = FinetuningSettings(finetuning_type=str(method), lora_rank=finetuning.get("lora_rank", 8),
                                  lora_alpha=finetuning.get("lora_alpha"),
                                  lora_target=tuple(finetuning.get(target_key(str(method))) or ("all",)),
                                  oft=OftSettings(finetuning.get("oft_rank", 0), finetuning.get("oft_block_size", 32)),
                                  score_head=reward is not None)
    return apply_finetuning(model, settings)


def reward_head_of(source: Path, run: dict[str, Any], tokenizer_from: str) -> RewardHead | None:
    """The score head when ``source`` is a reward model (stage rm): its run config says so, or its adapter's
    task (peft's SEQ_CLS) or its config's class (``...ForSequenceClassification``) does."""
    adapter_config = source / "adapter_config.json"
    adapter_task = json.loads(adapter_config.read_text()).get("task_type") if adapter_config.is_file() else None
    from shardtune.model.folder import read_config_json

    if run.get("stage") != "rm" and adapter_task != "SEQ_CLS" and not is_reward_model_config(read_config_json(source)):
        return None
    from shardtune.model.load import load_tokenizer

    # The seed draws the score layer's starting values, which the saved weights then replace.
    return RewardHead(load_tokenizer(tokenizer_from).pad_token_id, int(run.get("seed", 42)))


def load_checkpoint_weights(model: torch.nn.Module, source: Path, kind: str) -> int:
    """Copy the checkpoint's weights into ``model``; returns how many tensors were loaded."""
    state = read_checkpoint_state(model, source, kind)
    params = dict(model.state_dict())
    unknown = [k for k in state if k not in params]
    if unknown:
        raise ModelError(f"export: {source} has weights the model lacks, e.g. {unknown[:3]}; is --model the base "
                         "model this run trained?")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n in trainable if n not in state]
    if missing:
        raise ModelError(f"export: {source} lacks trained weights, e.g. {missing[:3]} (an incomplete save?)")
    model.load_state_dict(state, strict=False)
    return len(state)


def read_checkpoint_state(model: torch.nn.Module, source: Path, kind: str) -> dict[str, torch.Tensor]:
    for layout in checkpoint_layouts():
        if layout.name == kind:
            return layout.read(model, source)
    raise ModelError(f"export: cannot read weights of kind {kind}")


def _adapter_run_config(source: Path, method: str) -> dict[str, Any]:
    """An adapter's size (LoRA's rank, OFT's blocks) and target modules are known only from the run's config."""
    try:
        return find_run_config(source)
    except ModelError:
        raise ModelError(f"export: --finetuning-type {method} needs the run's {RUN_CONFIG} (its adapter size and "
                         f"{target_key(method)}) in {source} or its parent; copy it there from the run's "
                         "output_dir") from None


def check_export_inputs(source: Path, base: str) -> None:
    """The base model folder and the checkpoint's weight files, checked before anything is loaded."""
    from shardtune.model.folder import model_folder_problems, safetensors_file_problem

    problems = model_folder_problems(base, "export: base model") if Path(base).is_dir() else []
    for name in (WEIGHTS_FILE, "adapter_model.safetensors", "model.safetensors"):
        problem = safetensors_file_problem(source / name, "export an earlier checkpoint, or train again") \
            if (source / name).is_file() else None
        problems += [f"export: {problem}"] if problem else []
    if problems:
        raise ModelError(*problems)


@dataclass(frozen=True)
class ExportOptions:
    """How the exported folder comes out: dtype (None: the run's save_dtype, else auto), shard size, the template
    written into the tokenizer (None: the run's), replacing an existing folder, the merge device."""

    save_dtype: str | None = None
    max_shard_bytes: int | None = None
    template: str | None = None
    overwrite: bool = False
    device: str = "cpu"
    trust_remote_code: bool = False
    out_name: str = "--out"  # what the user called the destination: --out, or export_dir in FILE.yaml


@dataclass(frozen=True)
class TrainedSource:
    """A trained model to load: ``source`` of layout ``kind``, its base model and the run that wrote it."""

    source: Path
    kind: str
    base: str
    run: dict[str, Any]
    finetuning: dict[str, Any]

    @property
    def protected(self) -> dict[str, Path]:
        """What an export must never overwrite."""
        paths = {"the source": self.source}
        if Path(self.base).exists():
            paths["the base model"] = Path(self.base)
        return paths


def resolve_trained(source: Path, base: str | None = None, finetuning_type: str | None = None) -> TrainedSource:
    """What ``source`` holds and what it was trained from: the run's config says, else ``base`` and
    ``finetuning_type``; a model folder is its own base, an adapter names its base in adapter_config.json."""
    kind = checkpoint_kind(source)
    run = _run_config_if_any(source)
    if kind not in ("model", "adapter") and not run:
        if base is None or finetuning_type is None:
            find_run_config(source)  # raises: say what is missing
        if is_adapter_type(finetuning_type):
            run = _adapter_run_config(source, str(finetuning_type))
    base = base or run.get("model_name_or_path") or _own_base(source, kind)
    if not base:
        raise ModelError(f"the base model of {source} is unknown; pass --model")
    finetuning = {**run, "finetuning_type": finetuning_type or run.get("finetuning_type")}
    return TrainedSource(source, kind, base, run, finetuning)


def _own_base(source: Path, kind: str) -> str | None:
    if kind == "model":
        return str(source)
    if kind == "adapter":
        return json.loads((source / "adapter_config.json").read_text()).get("base_model_name_or_path")
    return None


def load_trained(trained: TrainedSource, merged_first: tuple[str, ...] = ()) -> tuple[torch.nn.Module, str]:
    """The trained model (float32, on the host) and where its tokenizer is read from. ``merged_first``: adapters
    merged into the base before an adapter ``source`` is loaded on it."""
    check_export_inputs(trained.source, trained.base)
    tokenizer_from = _tokenizer_source(trained.source, trained.base)
    reward = reward_head_of(trained.source, trained.run, tokenizer_from)
    if trained.kind == "model":
        model = _load_plain(trained.source, reward)
    elif trained.kind == "adapter":
        model = _load_adapter(trained.base, trained.source, reward, merged_first)
    else:
        model = build_trained_model(trained.base, trained.finetuning, reward)
        load_checkpoint_weights(model, trained.source, trained.kind)
    return model, tokenizer_from


def export_model(source: Path, out: Path, *, base: str | None = None, merge_lora: bool = False,
                 finetuning_type: str | None = None, options: ExportOptions | None = None,
                 merged_first: tuple[str, ...] = ()) -> list[str]:
    """Write ``out`` as a Hugging Face folder (safetensors, config, tokenizer) from ``source``; returns what was
    done to make it ready to serve, one line each. ``merged_first``: adapters merged into the base before
    ``source`` (an adapter) is loaded on it (LLaMA-Factory lists several in adapter_name_or_path)."""
    options = options or ExportOptions()
    trained = resolve_trained(source, base, finetuning_type)
    check_destination(out, {**trained.protected, **{f"the adapter {a}": Path(a) for a in merged_first}},
                      options.overwrite, options.out_name)
    model, tokenizer_from = load_trained(trained, merged_first)
    if options.device == "auto" and torch.cuda.is_available():
        model = model.to("cuda")
    if merge_lora and merges_adapter(model):
        model = model.merge_and_unload()
    settings = settings_from_run(trained.run, trained.base, template=options.template,
                                 save_dtype=options.save_dtype, max_shard_bytes=options.max_shard_bytes)
    record = {"source": str(source.resolve()), "base_model": trained.base, "merged_lora": bool(merge_lora)}
    with staged_folder(out, record) as staging:
        return save_exported(model.cpu(), staging, tokenizer_from, settings, options.trust_remote_code)


def _run_config_if_any(source: Path) -> dict[str, Any]:
    try:
        return find_run_config(source)
    except ModelError:
        return {}


def _load_plain(source: Path, reward: RewardHead | None) -> torch.nn.Module:
    from shardtune.model.load import load_causal_lm

    if reward is None:
        return load_causal_lm(str(source))
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(source), dtype=torch.float32)


def _load_adapter(base: str, source: Path, reward: RewardHead | None, merged_first: tuple[str, ...] = ()
                  ) -> torch.nn.Module:
    from peft import PeftModel

    from shardtune.model.load import load_causal_lm
    from shardtune.model.vocab import adapter_embedding_rows

    model = load_causal_lm(base)
    for earlier in merged_first:
        model = PeftModel.from_pretrained(model, earlier).merge_and_unload()
    rows = adapter_embedding_rows(str(source), model)  # trained with resize_vocab: the base grows first
    if rows is not None and rows != model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(rows, mean_resizing=False)
    if reward is not None:
        model = to_reward_model(model, reward)
    return PeftModel.from_pretrained(model, str(source))


def _tokenizer_source(source: Path, base: str) -> str:
    for folder in (source, source.parent):
        if (folder / "tokenizer_config.json").is_file():
            return str(folder)
    return base


def save_exported(model: torch.nn.Module, out: Path, tokenizer_from: str, settings: ServingSettings,
                  trust_remote_code: bool = False) -> list[str]:
    """Save weights (a full model in the dtype asked for, in shards of at most ``settings.max_shard_bytes``) and
    the tokenizer ready to serve, then check the written parameter count against the model's."""
    from shardtune.model.load import load_tokenizer
    from shardtune.model.saved import as_saves_pretrained, without_deepspeed_lookup

    is_adapter = hasattr(model, "peft_config")
    dtype = resolve_save_dtype(settings.save_dtype, settings.base_model)
    if not is_adapter:
        model = model.to(getattr(torch, dtype))
    shards = {"max_shard_size": settings.max_shard_bytes} if settings.max_shard_bytes and not is_adapter else {}
    with without_deepspeed_lookup():
        as_saves_pretrained(model).save_pretrained(out, safe_serialization=True, **shards)
    check_saved_count(model, out)
    return finish_servable(out, load_tokenizer(tokenizer_from, trust_remote_code=trust_remote_code), settings)


def check_saved_count(model: torch.nn.Module, out: Path) -> None:
    """An empty or partial save is an error, never a silent success."""
    from shardtune.model.saved import expected_saved_parameters, verify_saved

    verify_saved(out, expected_saved_parameters(model))
