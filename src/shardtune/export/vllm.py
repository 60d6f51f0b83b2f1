"""Whether vLLM loads an exported folder as it is, and if not, why and what to do.

The usual obstacles (vLLM's LoRA support as documented): an adapter whose rank exceeds the server's
``--max-lora-rank`` (16 by default), DoRA, ``modules_to_save`` (whole trained layers beside the adapter, e.g. the
embeddings of a grown vocabulary) and tokens added to the tokenizer; each goes away with ``--merge-lora``. A full
model folder has none of them; a reward model is served as a pooling model, not for generation.
"""

from __future__ import annotations

import json
from pathlib import Path

VLLM_DEFAULT_MAX_LORA_RANK = 16


def vllm_notes(folder: Path, base_vocab_size: int | None = None) -> list[str]:
    """One line per obstacle, or one line saying it loads as it is."""
    adapter_config = folder / "adapter_config.json"
    if adapter_config.is_file():
        return adapter_notes(json.loads(adapter_config.read_text()), tokenizer_size(folder), base_vocab_size)
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    architectures = config.get("architectures") or ["an unknown architecture"]
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return ["vLLM: a reward (sequence-classification) model: served by vLLM as a pooling model, not for "
                "generation"]
    return [f"vLLM: loadable as it is ({architectures[0]}, {config.get('dtype') or config.get('torch_dtype')}, "
            "safetensors)"]


def adapter_notes(config: dict, tokenizer_tokens: int | None, base_vocab_size: int | None) -> list[str]:
    rank = int(config.get("r") or 0)
    blockers = []
    if config.get("use_dora"):
        blockers.append("a DoRA adapter (vLLM's LoRA has no magnitude vectors)")
    if config.get("modules_to_save"):
        blockers.append(f"modules_to_save {list(config['modules_to_save'])} (whole layers vLLM's LoRA does not load)")
    if tokenizer_tokens is not None and base_vocab_size is not None and tokenizer_tokens > base_vocab_size:
        blockers.append(f"tokens added to the tokenizer ({tokenizer_tokens} > the base's {base_vocab_size})")
    if blockers:
        return ["vLLM: not loadable as a LoRA adapter: " + "; ".join(blockers)
                + ". Export with --merge-lora for a full model folder vLLM loads"]
    if rank > VLLM_DEFAULT_MAX_LORA_RANK:
        return [f"vLLM: loadable as a LoRA adapter with --enable-lora --max-lora-rank {rank} (rank {rank} is above "
                f"vLLM's default {VLLM_DEFAULT_MAX_LORA_RANK})"]
    return [f"vLLM: loadable as a LoRA adapter with --enable-lora (rank {rank})"]


def tokenizer_size(folder: Path) -> int | None:
    """Tokens of the folder's tokenizer.json (its vocabulary plus added tokens), None when there is none."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    ids = set((data.get("model") or {}).get("vocab", {}).values()) if isinstance(
        (data.get("model") or {}).get("vocab"), dict) else set()
    ids |= {token.get("id") for token in data.get("added_tokens", [])}
    return len(ids) or None
