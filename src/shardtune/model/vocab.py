"""New tokens and a grown vocabulary, as LLaMA-Factory does it (``add_tokens``, ``new_special_tokens``,
``resize_vocab``).

Tokens are added to the tokenizer before the data is tokenised, so each one encodes as a single id. When the
tokenizer then outgrows the model's embedding, the embedding and the output layer get rows up to the next multiple
of 64, and every new row starts as the mean of the existing rows plus Gaussian noise with standard deviation
1/sqrt(hidden size) (LLaMA-Factory's default ``noise_init``). The noise comes from its own generator seeded by
the run's seed, so the rows are the same on every rank and whether the model is loaded whole or filled shard by
shard (``grown_tensor`` is the one rule both paths call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardtune.errors import ModelError

if TYPE_CHECKING:  # torch is imported where it runs: `shardtune check` reads this module without it
    import torch

PAD_TO_MULTIPLE_OF = 64  # LLaMA-Factory's resize_token_embeddings(pad_to_multiple_of=64)


def add_new_tokens(tokenizer: Any, tokens: list[str], special_tokens: list[str]) -> int:
    """Add ``tokens`` (ordinary) and ``special_tokens`` (never split, kept by decode) to ``tokenizer``; the count
    of tokens it did not have."""
    added = 0
    if tokens:
        added += tokenizer.add_tokens(list(tokens), special_tokens=False)
    if special_tokens:
        added += tokenizer.add_tokens(list(special_tokens), special_tokens=True)
    if added:
        print(f"[shardtune] added {added} token(s) to the tokenizer: {','.join([*tokens, *special_tokens])}",
              flush=True)
    return added


@dataclass(frozen=True)
class VocabGrowth:
    """The embedding and output layer grow from ``old_rows`` to ``new_rows``; ``seed`` draws the new rows."""

    old_rows: int
    new_rows: int
    seed: int

    @property
    def is_growing(self) -> bool:
        return self.new_rows > self.old_rows


def plan_vocab_growth(tokenizer_size: int, embedding_rows: int, seed: int) -> VocabGrowth:
    """Grow to the tokenizer (padded to a multiple of 64) when it has more tokens than the embedding has rows."""
    if tokenizer_size <= embedding_rows:
        return VocabGrowth(embedding_rows, embedding_rows, seed)
    padded = math.ceil(tokenizer_size / PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF
    return VocabGrowth(embedding_rows, padded, seed)


def grown_tensor(old: torch.Tensor, growth: VocabGrowth, which: int) -> torch.Tensor:
    """``old`` with ``growth.new_rows - old_rows`` rows appended: their mean plus noise of std 1/sqrt(dim).

    ``which`` (0: input embedding, 1: output layer) gives each tensor its own noise, as LLaMA-Factory draws twice.
    """
    import torch

    if old.shape[0] != growth.old_rows:
        raise ModelError(f"resize_vocab: the embedding has {old.shape[0]} rows, expected {growth.old_rows}")
    values = old.detach().to(torch.float32)
    generator = torch.Generator().manual_seed(growth.seed + which)
    count, dim = growth.new_rows - growth.old_rows, values.shape[1]
    noise = torch.randn((count, dim), generator=generator, dtype=torch.float32) / math.sqrt(dim)
    new = values.mean(dim=0, keepdim=True) + noise
    return torch.cat([values.cpu(), new]).to(old.dtype)


def vocab_tensors(model: Any) -> list[torch.Tensor]:
    """The input embedding's weight, then the output layer's when it is a separate tensor."""
    found = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None and output.weight is not found[0]:
        found.append(output.weight)
    return found


def apply_vocab_growth(model: Any, growth: VocabGrowth) -> None:
    """Grow a loaded model's embedding and output layer to ``growth.new_rows`` by the rule of ``grown_tensor``."""
    import torch

    if not growth.is_growing:
        return
    if getattr(model, "quantization_method", None) or getattr(model, "is_quantized", False):
        raise ModelError("resize_vocab: the embedding of a quantized model cannot grow; remove quantization_bit")
    old = [t.detach().clone() for t in vocab_tensors(model)]
    # transformers draws the new rows from the global generator before we overwrite them; forking keeps the draws
    # of the fine-tuning step that follows the same as after a shard-by-shard fill, which draws nothing here.
    with torch.random.fork_rng(devices=[]):
        model.resize_token_embeddings(growth.new_rows, mean_resizing=False)
    with torch.no_grad():
        for which, (tensor, before) in enumerate(zip(vocab_tensors(model), old, strict=True)):
            tensor.copy_(grown_tensor(before, growth, which))
    print(f"[shardtune] resize_vocab: embedding {growth.old_rows} -> {growth.new_rows} rows", flush=True)


def adapter_embedding_rows(adapter_dir: str, model: Any) -> int | None:
    """Rows of the input embedding an adapter folder saved (a LoRA run with a grown vocabulary), else None."""
    from pathlib import Path

    from safetensors import safe_open

    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.is_file():
        return None
    module = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is module)
    with safe_open(str(path), "pt") as f:
        for key in f.keys():
            if key.endswith(f"{name}.weight") and ".lora_" not in key:
                return int(f.get_slice(key).get_shape()[0])
    return None
