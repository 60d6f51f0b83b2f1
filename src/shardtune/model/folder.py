"""Check a local model folder before anything loads it: config.json, tokenizer files and weight files.

Run on the launching host (``shardtune check`` and before ``train`` spawns ranks), so a damaged download is one
line naming the file instead of a traceback from transformers or safetensors in every rank. Only headers and small
JSON files are read, never the weights themselves. No torch import: ``check`` stays fast.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

from shardtune.errors import ModelError
from shardtune.paths import home_expanded
from shardtune.versions import installed_version

CONFIG_FILE = "config.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# Any one of these lets AutoTokenizer build a tokenizer (fast, sentencepiece, or BPE/WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt",
                   "tokenizer_config.json")
_JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_REMEDY = "save or download the model again"


def read_config_json(folder: str | Path) -> dict[str, Any] | None:
    """The folder's config.json as a mapping (None when it has none); a damaged one is a ModelError naming it."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return None
    data, problem = _read_json_object(path)
    if problem:
        raise ModelError(f"model_name_or_path: {problem}")
    return data


def model_config_json(name: str | None) -> dict[str, Any] | None:
    """The model's config.json: a local folder's, or a hub id's already in the Hugging Face cache; None when this
    machine has neither. The one reader of a model's config before weights load (attention, DeepSpeed's "auto"
    sizes and the estimate all ask it). Never downloads."""
    if not name:
        return None
    local = read_config_json(home_expanded(name))
    if local is not None or home_expanded(name).exists():
        return local
    cached = hub_cache_config(name)
    if cached is None:
        return None
    data, problem = _read_json_object(cached)
    if problem:
        raise ModelError(f"model_name_or_path: {problem}")
    return data


PRE_QUANTIZED = ("gptq", "awq", "aqlm", "eetq", "hqq", "exl2", "fp8", "compressed-tensors", "bitnet")


def pre_quantized_method(name: str | None) -> str | None:
    """The quantization method of a pre-quantized checkpoint (its config.json says so), else None."""
    quant = (model_config_json(name) or {}).get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    return method if method in PRE_QUANTIZED else None


def hub_cache_config(model_id: str) -> Path | None:
    """config.json of a hub id already in the Hugging Face cache (newest snapshot), without huggingface_hub."""
    if "/" not in model_id or model_id.startswith((".", "/", "~")):
        return None
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    snapshots = Path(cache) / f"models--{model_id.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def model_folder_problems(folder: str | Path, key: str = "model_name_or_path") -> list[str]:
    """Everything wrong with a local model folder, one line each; empty when it looks loadable."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        if (folder / ADAPTER_CONFIG_FILE).is_file():
            return []  # an adapter folder: its base model is checked when it is loaded
        return [f"{key}: {folder} has no config.json (is it a Hugging Face model folder?)"]
    problems = _config_problems(folder / CONFIG_FILE)
    problems += _tokenizer_problems(folder)
    problems += weights_problems(folder)
    return [f"{key}: {p}" for p in problems]


def _config_problems(path: Path) -> list[str]:
    data, problem = _read_json_object(path)
    if problem:
        return [problem]
    model_type = data.get("model_type")
    if not model_type:
        return [f"{path} has no model_type, so transformers cannot tell the architecture; {_REMEDY}"]
    if "auto_map" not in data and not _is_known_model_type(str(model_type)):  # (auto_map: the model's own code)
        return [f"{path}: model_type {model_type!r} is not known to the installed transformers "
                f"{_transformers()}{_closest_model_type(str(model_type))}; fix config.json, or install the "
                "transformers release that added it"]
    if "auto_map" not in data:
        return (untrainable_problems(path, str(model_type), data)
                or _no_causal_lm_problems(path, str(model_type), data) + _language_problems(path, data))
    return []


# Model types transformers maps to a causal-LM class that still cannot be fine-tuned as one, with the reason
# (found by the registry matrix: tests/distributed/test_registry_matrix.py).
_DRAFT = ("a draft model for Gemma 4's speculative decoding: its forward reads the main model's embeddings and "
          "key/value caches, so it does not train alone; fine-tune the Gemma 4 model it drafts for")
_MUSIC = ("a text-to-music model: its causal LM predicts audio codebooks and is built from the decoder part of the "
          "composite config this checkpoint holds; shardtune fine-tunes text LMs")
UNTRAINABLE_FAMILIES: dict[str, str] = {
    "gemma4_assistant": _DRAFT,
    "gemma4_unified_assistant": _DRAFT,
    "musicgen": _MUSIC,
    "musicgen_melody": _MUSIC,
    # transformers' CpmAntModel sets its whole input as context, so every token attends to the tokens after it
    # too (a later token changes an earlier one's logits by 28 on the tiny model): as a causal LM it would learn
    # from the tokens it predicts, and its loss depends on the padding of each micro-batch
    "cpmant": ("CPM-Ant's forward attends in both directions (transformers treats the whole input as context), so a "
               "causal LM trained with it sees the tokens it predicts; fine-tune another decoder LM"),
    "reformer": ("Reformer trains only on rows exactly as long as its axial position table (axial_pos_shape's "
                 "product), while shardtune's rows are as long as their samples; fine-tune another decoder LM"),
}
# Vision towers transformers builds through timm (TimmWrapper): the package must be installed to load them.
TIMM_TOWERS = ("gemma3n_vision", "timm_wrapper")


def untrainable_problems(path: Path, model_type: str, data: dict[str, Any]) -> list[str]:
    """A family that cannot be fine-tuned (``UNTRAINABLE_FAMILIES``), or a vision tower whose package is missing."""
    import importlib.util

    if reason := UNTRAINABLE_FAMILIES.get(model_type):
        return [f"{path}: model_type {model_type!r}: {reason}"]
    vision = data.get("vision_config")
    tower = vision.get("model_type") if isinstance(vision, dict) else None
    if tower in TIMM_TOWERS and importlib.util.find_spec("timm") is None:
        return [f"{path}: its vision tower ({tower}) is a timm model, and timm is not installed: "
                "pip install timm"]
    return []


def _language_problems(path: Path, data: dict[str, Any]) -> list[str]:
    """X-MOD sends each row through one language's adapters, chosen by ``lang_ids`` (which shardtune's batches do
    not carry) or else the config's ``default_language``; without one every forward raises "Input language
    unknown"."""
    if data.get("model_type") != "xmod" or data.get("default_language"):
        return []
    languages = ", ".join(map(str, data.get("languages") or [])) or "its languages"
    return [f"{path}: X-MOD picks each row's language adapters from default_language, which is not set; set "
            f"\"default_language\" in config.json to one of {languages}"]


def _no_causal_lm_problems(path: Path, model_type: str, data: dict[str, Any]) -> list[str]:
    """A model type transformers knows but builds no causal LM for (an encoder such as ``bert``): every rank would
    fail at load with "cannot load a causal LM", so say it here. Image-text folders load as their image-text class
    (model/composite.py)."""
    from shardtune.model.composite import image_text_class_name
    from shardtune.model.transformers_tables import causal_lm_class_name, table

    if not table("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") or causal_lm_class_name(model_type) \
            or image_text_class_name(data):
        return []  # an unreadable table decides nothing
    return [f"{path}: model_type {model_type!r} has no causal-LM class in transformers {_transformers()} "
            "(AutoModelForCausalLM cannot build it); shardtune fine-tunes causal LMs: use a decoder LM checkpoint"]


def _is_known_model_type(model_type: str) -> bool:
    from shardtune.model.transformers_tables import known_model_types

    known = known_model_types()
    return not known or model_type in known  # an unreadable table decides nothing


def _closest_model_type(model_type: str) -> str:
    import difflib

    from shardtune.model.transformers_tables import known_model_types

    close = difflib.get_close_matches(model_type, sorted(known_model_types()), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _transformers() -> str:
    return installed_version("transformers") or "(not installed)"


def _tokenizer_problems(folder: Path) -> list[str]:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return [f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); copy the tokenizer "
                "into the model folder (tokenizer.save_pretrained)"]
    problems = [problem for name in _JSON_TOKENIZER_FILES if (folder / name).is_file()
                and (problem := _read_json_object(folder / name)[1])]
    return problems or _tokenizer_json_problems(folder / "tokenizer.json")


def _tokenizer_json_problems(path: Path) -> list[str]:
    """A tokenizer.json that is JSON but not a tokenizer: the tokenizers library (Rust, quick to load) reads it as
    the ranks' AutoTokenizer would."""
    if not path.is_file():
        return []
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return []
    try:
        Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises a bare Exception with its parser's message
        return [f"{path} is not a tokenizer the tokenizers library can read ({err}); save or download the tokenizer "
                "again"]
    return []


def weights_problems(folder: Path) -> list[str]:
    """Missing, truncated or unreadable weight files (headers only)."""
    if (folder / SAFETENSORS_INDEX).is_file():
        return _index_problems(folder / SAFETENSORS_INDEX, safetensors_file_problem)
    if (folder / "model.safetensors").is_file():
        return _listed([safetensors_file_problem(folder / "model.safetensors")])
    if (folder / BIN_INDEX).is_file():
        return _index_problems(folder / BIN_INDEX, _torch_file_problem)
    if (folder / "pytorch_model.bin").is_file():
        return _listed([_torch_file_problem(folder / "pytorch_model.bin")])
    return [f"{folder} has no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin); "
            f"{_REMEDY}"]


def _index_problems(index: Path, file_problem) -> list[str]:
    data, problem = _read_json_object(index)
    if problem:
        return [problem]
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        return [f"{index} has no weight_map; {_REMEDY}"]
    problems = []
    for name in sorted(set(map(str, weight_map.values()))):
        path = index.parent / name
        problems.append(file_problem(path) if path.is_file() else
                        f"{path} is listed in {index.name} but missing; {_REMEDY}")
    return _listed(problems)


def _listed(problems: list[str | None]) -> list[str]:
    return [p for p in problems if p]


def safetensors_file_problem(path: Path, remedy: str = _REMEDY) -> str | None:
    """Why ``path`` cannot be read (None when it can).

    A safetensors file is an 8-byte header length, a JSON header, then exactly the bytes the header lists.
    """
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8)) if size >= 8 else (-1,)
            if header_len < 0 or 8 + header_len > size:
                return f"{path} is truncated ({size} bytes, shorter than its own header); {remedy}"
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError, struct.error) as err:
        return f"{path} cannot be read as safetensors ({err}); {remedy}"
    if not isinstance(header, dict):
        return f"{path} cannot be read as safetensors (its header is not a mapping); {remedy}"
    ends = [info["data_offsets"][1] for name, info in header.items()
            if name != "__metadata__" and isinstance(info, dict) and len(info.get("data_offsets", ())) == 2]
    expected, present = max(ends, default=0), size - 8 - header_len
    if present != expected:  # safetensors refuses any difference ("file not fully covered")
        state = "truncated" if present < expected else "damaged"
        return (f"{path} is {state}: its header lists {expected} bytes of tensors, the file holds {present}; "
                f"{remedy}")
    return None


def _torch_file_problem(path: Path) -> str | None:
    # torch.save writes zip archives; a cut-off one has lost its central directory at the end of the file.
    with path.open("rb") as handle:
        is_zip_start = handle.read(2) == b"PK"
    if is_zip_start and not zipfile.is_zipfile(path):
        return f"{path} is truncated or damaged (an incomplete zip archive); {_REMEDY}"
    return None


def _read_json_object(path: Path) -> tuple[dict[str, Any], str | None]:
    """(mapping, None), or ({}, one line naming the file, line and column of what is wrong)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        return {}, f"{path} line {err.lineno}, column {err.colno}: not valid JSON ({err.msg}); {_REMEDY}"
    except (OSError, UnicodeDecodeError) as err:
        return {}, f"{path} cannot be read ({err}); {_REMEDY}"
    if not isinstance(data, dict):
        return {}, f"{path} must hold a JSON object, not {type(data).__name__}; {_REMEDY}"
    return data, None


def is_reward_model_config(config: dict[str, Any] | None) -> bool:
    """Does a model's config.json name a sequence-classification class (a full reward model's output)?"""
    architectures = (config or {}).get("architectures")
    return isinstance(architectures, list) and any(str(name).endswith("ForSequenceClassification")
                                                   for name in architectures)
