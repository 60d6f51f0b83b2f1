"""Make a saved model folder ready to serve: the dtype asked for, the training template as the tokenizer's chat
template, the template's stop token as eos and in ``generation_config.json``, a pad token.

Used by the final save of a run, by ``shardtune export`` and by a merged LoRA export, after the weights are
written: the weights are rewritten one tensor at a time into shards of at most ``max_shard_bytes`` (the engines
save in their training precision, float32 master weights most often); a folder already in the dtype is left as is.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtune.errors import ConfigError
from shardtune.paths import home_expanded

SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_SHARD_BYTES = 5 * 2**30
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class ServingSettings:
    """What the run trained with and how the saved folder should come out.

    ``template`` None keeps the tokenizer's own chat template (an export that does not know the run's template).
    ``save_dtype`` auto: the dtype of ``base_model``'s checkpoint (its config.json), float32 when it says none.
    """

    template: str | None
    base_model: str
    default_system: str | None = None
    enable_thinking: bool = True
    tool_format: str | None = None
    replace_eos: bool = True
    save_dtype: str = "auto"
    max_shard_bytes: int | None = None  # None: shard sizes as saved, unless the dtype changes


def settings_from_run(run: dict[str, Any], base_model: str, **overrides: Any) -> ServingSettings:
    """Serving settings from a run's resolved config (shardtune_config.json), keys absent there at their
    defaults; ``overrides`` that are None are ignored."""
    values: dict[str, Any] = {"template": run.get("template"), "base_model": base_model,
                              "default_system": run.get("default_system"),
                              "enable_thinking": run.get("enable_thinking", True),
                              "tool_format": run.get("tool_format"), "replace_eos": run.get("replace_eos", True),
                              "save_dtype": run.get("save_dtype", "auto")}
    values.update({key: value for key, value in overrides.items() if value is not None})
    return ServingSettings(**values)


def finish_servable(folder: Path, tokenizer: Any, settings: ServingSettings) -> list[str]:
    """Write the tokenizer and fix dtype and generation config of the model folder ``folder``; returns what was
    changed, one line each, for the run log. An adapter folder gets the tokenizer only."""
    notes = save_serving_tokenizer(tokenizer, settings, folder) + copy_processor_files(settings.base_model, folder)
    if not is_model_folder(folder):
        return notes
    dtype = resolve_save_dtype(settings.save_dtype, settings.base_model)
    if cast_saved_weights(folder, dtype, settings.max_shard_bytes):
        notes.append(f"weights saved in {dtype} (save_dtype: {settings.save_dtype})")
    notes += update_generation_config(folder, tokenizer)
    return notes


# The processor's files of an image-text checkpoint: a saved model (or adapter) reads images as the download did.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def copy_processor_files(base_model: str, folder: Path) -> list[str]:
    """The base model's processor files into ``folder`` (those it lacks), from where they were loaded: a local
    folder, or for a hub id the Hugging Face cache as transformers resolves it (AutoImageProcessor read them there)."""
    found = {name: path for name in PROCESSOR_FILES
             if not (folder / name).exists() and (path := processor_file(base_model, name)) is not None}
    for name, path in found.items():
        shutil.copyfile(path, folder / name)
    return [f"copied {', '.join(found)} from the base model (the image processor)"] if found else []


def processor_file(base_model: str, name: str) -> Path | None:
    """Where the base model's file ``name`` is: in its folder, or a hub id's through transformers (the cache, or a
    download where the hub is reachable, as the weights came), asked only of an image-text model so that a text
    model's save makes no hub requests. None when it has none."""
    from shardtune.model.composite import image_text_class_name
    from shardtune.model.folder import model_config_json

    if home_expanded(base_model).exists():
        path = home_expanded(base_model) / name
        return path if path.is_file() else None
    config = model_config_json(base_model)
    if config is None or image_text_class_name(config) is None:
        return None
    from transformers.utils import cached_file  # transformers: only once a hub id's image-text model needs it

    resolved = cached_file(base_model, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    return Path(resolved) if resolved else None


def is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file()


def save_serving_tokenizer(tokenizer: Any, settings: ServingSettings, folder: Path) -> list[str]:
    """The tokenizer with the training template as its chat template (rendering the special tokens as trained) and
    the template's stop token as its eos (``replace_eos``)."""
    from shardtune.data.templates import TokenizerChatTemplate, get_template
    from shardtune.data.templates.jinja import chat_template_jinja

    notes: list[str] = []
    if settings.template is None:
        tokenizer.save_pretrained(folder)
        return notes
    template = get_template(settings.template, settings.default_system, settings.enable_thinking,
                            settings.tool_format)
    if not isinstance(template, TokenizerChatTemplate):
        tokenizer.chat_template = chat_template_jinja(template, tokenizer,
                                                      trained_special_tokens(tokenizer, settings.base_model))
        notes.append(f"chat template: '{template.name}' as trained")
    stop = template.stop_token(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if settings.replace_eos and stop != tokenizer.eos_token:
        if stop in tokenizer.get_vocab():
            notes.append(f"eos_token: {tokenizer.eos_token} -> {stop}, the template's stop token (replace_eos)")
            tokenizer.eos_token = stop
        else:
            notes.append(f"eos_token stays {tokenizer.eos_token}: the template's stop token {stop} is not one token "
                         "of this tokenizer")
    tokenizer.save_pretrained(folder)
    return notes


def trained_special_tokens(tokenizer: Any, base_model: str) -> dict[str, str]:
    """``{bos}``/``{eos}`` as training rendered them: the base model's tokenizer's own (a tokenizer saved by an
    earlier run may carry the stop token as eos since), else ``tokenizer``'s."""
    from shardtune.data.templates import special_token_strings

    specials = special_token_strings(tokenizer)
    path = Path(base_model) / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        for placeholder, key in (("{bos}", "bos_token"), ("{eos}", "eos_token")):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and value:
                specials[placeholder] = value
    return specials


def update_generation_config(folder: Path, tokenizer: Any) -> list[str]:
    """``generation_config.json``: the tokenizer's eos first among ``eos_token_id`` (the ids it had stay, so the
    base model's own end of text still stops), ``pad_token_id`` the tokenizer's."""
    from transformers import GenerationConfig

    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    config = GenerationConfig.from_pretrained(folder)
    had = config.eos_token_id
    before = [had] if isinstance(had, int) else list(had or [])
    eos = [tokenizer.eos_token_id, *[i for i in before if i != tokenizer.eos_token_id]]
    config.eos_token_id = eos[0] if len(eos) == 1 else eos
    config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(folder)
    return [f"generation_config.json: eos_token_id {config.eos_token_id}"] if eos != before else []


def checkpoint_dtype(model_name_or_path: str) -> str:
    """The dtype a model folder's config.json declares (``dtype``, or ``torch_dtype`` before transformers 5);
    float32 when it declares none or is not a local folder."""
    path = Path(model_name_or_path) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        declared = config.get("dtype") or config.get("torch_dtype")
    else:  # a hub id: its cached config, when there is one
        from transformers import AutoConfig

        try:
            declared = AutoConfig.from_pretrained(model_name_or_path, local_files_only=True).dtype
        except (OSError, ValueError):
            declared = None
    declared = str(declared or "float32").removeprefix("torch.")
    return declared if declared in SAVE_DTYPES[1:] else "float32"


def resolve_save_dtype(save_dtype: str, base_model: str) -> str:
    if save_dtype not in SAVE_DTYPES:
        raise ConfigError(f"save_dtype ({save_dtype}): choose one of {', '.join(SAVE_DTYPES)}")
    return checkpoint_dtype(base_model) if save_dtype == "auto" else save_dtype


def cast_saved_weights(folder: Path, dtype: str, max_shard_bytes: int | None = None) -> bool:
    """Rewrite the folder's safetensors weights with every floating tensor in ``dtype``, and say so in config.json.
    The files are rewritten when a tensor has another dtype or a file is larger than ``max_shard_bytes`` (None:
    sizes are left alone); new shards hold at most ``max_shard_bytes`` (5 GiB when None). True when anything
    changed; one tensor at a time is read."""
    from safetensors import safe_open

    target = getattr(torch, dtype)
    files = sorted(folder.glob("*.safetensors"))
    stored = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            stored.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    wanted = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    needs_cast = any(code in wanted and wanted[code] != target for code in stored.values())
    config_changed = set_config_dtype(folder, dtype)
    if needs_cast or _shards_too_large(files, max_shard_bytes):
        rewrite_shards(folder, files, target, max_shard_bytes or DEFAULT_SHARD_BYTES)
        return True
    return config_changed


def _shards_too_large(files: list[Path], max_shard_bytes: int | None) -> bool:
    return max_shard_bytes is not None and any(path.stat().st_size > max_shard_bytes for path in files)


def rewrite_shards(folder: Path, files: list[Path], target: torch.dtype, max_shard_bytes: int) -> None:
    """Cast and re-shard into a sibling folder, then swap the weight files in (the old ones go last)."""
    from safetensors import safe_open

    from shardtune.engines.deepspeed_save import SafetensorsShardWriter

    staging = folder / ".recast"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    writer = SafetensorsShardWriter(staging, max_shard_bytes)
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                writer.add(name, tensor.to(target) if tensor.is_floating_point() else tensor)
    new_files = writer.finish()
    for path in files:
        path.unlink()
    (folder / INDEX_FILE).unlink(missing_ok=True)
    for path in [*new_files, staging / INDEX_FILE]:
        if path.is_file():
            path.rename(folder / path.name)
    staging.rmdir()


def set_config_dtype(folder: Path, dtype: str) -> bool:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if config.get("dtype") == dtype and config.get("torch_dtype", dtype) == dtype:
        return False
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return True
