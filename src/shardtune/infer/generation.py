"""Generation settings under LLaMA-Factory's names, as arguments of transformers' ``generate``; shared by
``do_predict`` and ``shardtune chat``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardtune.config.schema import TrainConfig


@dataclass(frozen=True)
class GenerationSettings:
    """How answers are generated (LLaMA-Factory's generating_args and defaults)."""

    do_sample: bool = True
    temperature: float = 0.95
    top_p: float = 0.7
    top_k: int = 50
    num_beams: int = 1
    max_new_tokens: int = 1024
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0
    skip_special_tokens: bool = True

    def generate_kwargs(self, stop_ids: list[int], pad_token_id: int | None) -> dict[str, Any]:
        """Keyword arguments of ``generate``: greedy leaves the sampling knobs out (transformers would warn that
        they are unused), ``stop_ids`` end an answer (the template's stop token first)."""
        kwargs: dict[str, Any] = {"do_sample": self.do_sample, "num_beams": self.num_beams,
                                  "max_new_tokens": self.max_new_tokens,
                                  "repetition_penalty": self.repetition_penalty, "eos_token_id": stop_ids,
                                  "pad_token_id": pad_token_id if pad_token_id is not None else stop_ids[0]}
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if self.num_beams > 1:
            kwargs["length_penalty"] = self.length_penalty
        return kwargs


def generation_settings(c: TrainConfig) -> GenerationSettings:
    return GenerationSettings(do_sample=c.do_sample, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              num_beams=c.num_beams, max_new_tokens=c.max_new_tokens,
                              repetition_penalty=c.repetition_penalty, length_penalty=c.length_penalty,
                              skip_special_tokens=c.skip_special_tokens)


def stop_token_ids(tokenizer: Any, stop_token: str) -> list[int]:
    """The template's stop token and the tokenizer's eos (each once): either ends an answer."""
    ids = []
    stop = tokenizer.convert_tokens_to_ids(stop_token) if stop_token in tokenizer.get_vocab() else None
    for token_id in (stop, tokenizer.eos_token_id):
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    return ids


def answer_ids(generated: list[int], stop_ids: list[int]) -> list[int]:
    """The generated ids up to (not including) the first stop token; generate pads finished rows after it."""
    for position, token in enumerate(generated):
        if token in stop_ids:
            return generated[:position]
    return generated
