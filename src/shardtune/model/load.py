"""Load a tokenizer and a causal LM from a local folder (or hub id) the way transformers does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtune.errors import ModelError


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer, with a pad token guaranteed (eos when the tokenizer has none)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelError(f"model_name_or_path: cannot load a tokenizer from {name_or_path}: {err}") from None
    if tokenizer.pad_token_id is None:
        # Padding is masked out of the loss, so reusing eos as pad is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def quantization_config(bits: int, compute_dtype: Any) -> Any:
    """bitsandbytes settings for QLoRA; storage dtype matches compute dtype so FSDP can shard it."""
    import torch

    if not torch.cuda.is_available():
        raise ModelError(f"quantization_bit ({bits}) needs a CUDA GPU and bitsandbytes; none is visible here. "
                         "Remove quantization_bit to train in full precision.")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelError(f"quantization_bit ({bits}) needs bitsandbytes: pip install bitsandbytes") from None
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=compute_dtype,
    )


def load_causal_lm(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    quantization_bit: int | None = None,
    compute_dtype: Any = None,
) -> Any:
    """Load weights in float32 (mixed precision autocasts); quantized loads go through bitsandbytes."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "attn_implementation": attn_implementation,
                              "dtype": torch.float32}
    if quantization_bit is not None:
        kwargs["quantization_config"] = quantization_config(quantization_bit, compute_dtype or torch.bfloat16)
        kwargs["dtype"] = compute_dtype or torch.bfloat16
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, ImportError) as err:
        raise ModelError(f"model_name_or_path: cannot load a causal LM from {name_or_path}: {err}") from None
    return model


def has_model_files(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()
