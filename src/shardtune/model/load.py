"""Load a tokenizer and a causal LM from a local folder (or hub id) the way transformers does."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune.data.settings import VARLEN
from shardtune.errors import ModelError
from shardtune.model.folder import hub_cache_config
from shardtune.paths import home_expanded, reads_as_hub_id

_DEFAULT_ENDPOINT = "https://huggingface.co"


def offline_hub_problems(name: str | None, builds_model: bool) -> list[str]:
    """A hub id not in the Hugging Face cache while HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE forbid downloading it:
    refused before launch, rather than by every rank once it starts loading (``builds_model``: a tiny model is
    built at that path instead, nothing is downloaded)."""
    if not name or builds_model or not reads_as_hub_id(name) or home_expanded(name).exists():
        return []
    switch = next((key for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if _is_on(os.environ.get(key))), None)
    if switch is None or hub_cache_config(name) is not None:
        return []
    return [f"model_name_or_path: {name} is not in the Hugging Face cache and {switch}={os.environ[switch]} "
            f"forbids downloading it; {_download_remedy(name)}"]


def _is_on(value: str | None) -> bool:
    """huggingface_hub's reading of a switch variable (constants._is_true)."""
    return (value or "").upper() in ("1", "ON", "YES", "TRUE")


def _download_remedy(name: str) -> str:
    return (f"download it first with `hf download {name}` where the hub is reachable (into the same HF_HOME), or "
            "give a local model folder")


def unreached_hub_error(name: str, err: BaseException) -> ModelError | None:
    """One line for a load that failed because the hub did not answer (or offline mode forbade asking) and the
    files are not cached: huggingface_hub has already retried with its own bounded timeouts (HF_HUB_ETAG_TIMEOUT,
    HF_HUB_DOWNLOAD_TIMEOUT, 10 s each by default). None for any other failure."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    chain = _causes(err)
    if not any(isinstance(e, LocalEntryNotFoundError) for e in chain):
        return None
    if constants.HF_HUB_OFFLINE:
        return ModelError(f"model_name_or_path: {name} is not in the Hugging Face cache and offline mode "
                          f"(HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE) forbids downloading it; {_download_remedy(name)}")
    where = "HF_ENDPOINT " + constants.ENDPOINT if constants.ENDPOINT != _DEFAULT_ENDPOINT else constants.ENDPOINT
    reason = str(chain[-1]).splitlines()[0] if str(chain[-1]) else type(chain[-1]).__name__
    return ModelError(f"model_name_or_path: {name} is not in the Hugging Face cache and the hub ({where}) did not "
                      f"answer ({reason}); {_download_remedy(name)}")


def _causes(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions behind it, outermost first."""
    chain = [err]
    while (behind := chain[-1].__cause__ or chain[-1].__context__) is not None and behind not in chain:
        chain.append(behind)
    return chain


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer, with a pad token guaranteed (eos when the tokenizer has none)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise unreached_hub_error(name_or_path, err) or ModelError(
            f"model_name_or_path: cannot load a tokenizer from {name_or_path}: {err}") from None
    if tokenizer.pad_token_id is None:
        # Padding is masked out of the loss, so reusing eos as pad is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass(frozen=True)
class Quantization:
    """How the base model is quantized on load (bitsandbytes): LLaMA-Factory's quantization_* keys."""

    bits: int
    quant_type: str = "nf4"
    double_quant: bool = True


def quantization_config(quant: Quantization, compute_dtype: Any) -> Any:
    """bitsandbytes settings for QLoRA, after checking that CUDA and bitsandbytes are here."""
    import torch

    if not torch.cuda.is_available():
        raise ModelError(f"quantization_bit ({quant.bits}) needs a CUDA GPU and bitsandbytes; none is visible here. "
                         "Remove quantization_bit to train in full precision.")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelError(f"quantization_bit ({quant.bits}) needs bitsandbytes: pip install bitsandbytes") from None
    return bitsandbytes_config(quant, compute_dtype)


def bitsandbytes_config(quant: Quantization, compute_dtype: Any) -> Any:
    """The transformers config object; storage dtype matches compute dtype so FSDP can shard 4-bit weights."""
    from transformers import BitsAndBytesConfig

    if quant.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.quant_type,
        bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=compute_dtype,
    )


def load_model_config(name_or_path: str, *, trust_remote_code: bool = False, rope_scaling: str | None = None,
                      max_length: int | None = None) -> Any:
    """The model's config, with RoPE scaling set the way LLaMA-Factory sets it (``apply_rope_scaling``)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise unreached_hub_error(name_or_path, err) or ModelError(
            f"model_name_or_path: cannot read the config of {name_or_path}: {err}") from None
    if rope_scaling is not None:
        apply_rope_scaling(config, rope_scaling, max_length)
    return config


def apply_rope_scaling(config: Any, rope_type: str, max_length: int | None) -> bool:
    """Stretch RoPE so ``max_length`` tokens fit: factor = ceil(max_length / trained context); True when applied.

    Like LLaMA-Factory, nothing changes (and a line says so) when ``max_length`` already fits the trained context.
    """
    trained = getattr(config, "max_position_embeddings", None)
    if getattr(config, "rope_parameters", None) is None or not trained:
        raise ModelError(f"rope_scaling ({rope_type}): the model ({config.model_type}) has no RoPE settings to scale")
    if not max_length or max_length <= trained:
        print(f"[shardtune] rope_scaling ({rope_type}) not applied: cutoff_len ({max_length}) fits the model's "
              f"context ({trained})", flush=True)
        return False
    factor = float(math.ceil(max_length / trained))
    params: dict[str, Any] = {**config.rope_parameters, "rope_type": rope_type, "factor": factor}
    if rope_type in ("dynamic", "yarn", "llama3"):
        params["original_max_position_embeddings"] = trained
    if rope_type in ("yarn", "llama3"):
        config.max_position_embeddings = int(trained * factor)
    if rope_type == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    config.rope_parameters = params
    print(f"[shardtune] rope_scaling: {rope_type} with factor {factor:g} ({trained} -> {max_length} tokens)",
          flush=True)
    return True


def check_attention(attn_implementation: str) -> None:
    """flash_attention_2 needs CUDA and the flash-attn package; say so before loading instead of deep inside.
    varlen is shardtune's own kernel: registered with transformers here, before a model can load with it."""
    if attn_implementation == VARLEN:
        from shardtune.model.varlen import register_varlen

        register_varlen()
    if attn_implementation != "flash_attention_2":
        return
    import importlib.util

    import torch

    from shardtune.model.attention import flash_problem

    problem = flash_problem(torch.cuda.is_available(), importlib.util.find_spec("flash_attn") is not None)
    if problem:
        raise ModelError(problem)


def load_causal_lm(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    attn_implementation: str = "auto",
    quantization: Quantization | None = None,
    compute_dtype: Any = None,
    config: Any = None,
) -> Any:
    """Load weights in float32 (mixed precision autocasts); quantized loads go through bitsandbytes.
    ``auto`` (export, reload; training resolves it before) leaves the kernel to transformers' default: sdpa where
    the model supports it, else eager (Gemma 2, GPT-OSS). An image-text folder loads as its image-text class, vision
    tower included (model/composite.py)."""
    import torch

    from shardtune.model.composite import auto_model_class

    check_attention(attn_implementation)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "dtype": torch.float32,
                              "attn_implementation": None if attn_implementation == "auto" else attn_implementation}
    if config is None:
        config = load_model_config(name_or_path, trust_remote_code=trust_remote_code)
    kwargs["config"] = config
    if quantization is not None:
        kwargs["quantization_config"] = quantization_config(quantization, compute_dtype or torch.bfloat16)
        kwargs["dtype"] = compute_dtype or torch.bfloat16
    try:
        model = auto_model_class(config).from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, ImportError) as err:
        raise unreached_hub_error(name_or_path, err) or ModelError(
            f"model_name_or_path: cannot load a causal LM from {name_or_path}: {err}") from None
    return model


def has_model_files(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()
