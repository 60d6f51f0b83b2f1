"""Rollouts of stage grpo: ``generate(prompt ids, n, sampling) -> completion ids and their log-probabilities``.

One interface so that another back-end (vLLM, with its own copy of the weights) can plug in later; the one built is
``TransformersRollout``: the policy being trained generates with its own weights through ``Engine.generate``, which
gathers sharded weights (ZeRO-3, FSDP) as do_predict does, so no copy of the weights is ever made or synced. Its
sampler is the trainer, so it reports no sampler log-probabilities: keeping generate's logits for them would hold
n x max_completion_length x vocab fp32 numbers (2.5 GB for 8 completions of 512 tokens over a 152k vocabulary) for a
correction that has no gap to correct.

Each group (the ``n`` completions of one prompt) is generated alone, with the random state seeded from the run's
seed and the prompt's row number: the completions of a prompt do not depend on the process count, the batch the
prompt lands in, or whether the run was resumed, and no padding sits in front of a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shardtune.engines.base import Engine

# Knuth's multiplicative constant spreads nearby row numbers over the seed space.
_SEED_STRIDE = 2654435761


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (transformers' sampling knobs, TRL's max_completion_length)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_completion_length: int = 256
    seed: int = 42


@dataclass(frozen=True)
class Completions:
    """``n`` completions of one prompt, right-padded: ids, the mask of the tokens that belong to each (up to and with
    its stop token), whether each ran out of length without one, and, from a generator with weights of its own, the
    sampler's log-probabilities of its tokens (at the sampling temperature, before top-p/top-k; 0 on padding)."""

    ids: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor
    logps: torch.Tensor | None = None


class Rollout(Protocol):
    def generate(self, prompt_ids: list[int], n: int, sampling: Sampling, row: int) -> Completions: ...


def row_seed(seed: int, row: int) -> int:
    return (seed * _SEED_STRIDE + row) % (2**63 - 1)


def completion_mask(ids: torch.Tensor, stop_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's tokens up to and with its first stop token, and whether it has none (truncated)."""
    stops = torch.isin(ids, torch.tensor(stop_ids, device=ids.device))
    has_stop = stops.any(dim=1)
    first = torch.where(has_stop, stops.int().argmax(dim=1), torch.full_like(has_stop, ids.shape[1], dtype=torch.long))
    mask = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) <= first.unsqueeze(1)
    return mask.long(), ~has_stop


class TransformersRollout:
    """The trained policy generates (every engine; see the module docstring)."""

    def __init__(self, engine: Engine, stop_ids: list[int], pad_token_id: int) -> None:
        self.engine = engine
        self.stop_ids = stop_ids
        self.pad_token_id = pad_token_id

    def generate(self, prompt_ids: list[int], n: int, sampling: Sampling, row: int) -> Completions:
        prompt = torch.tensor([prompt_ids] * n, dtype=torch.long)
        devices = [self.engine.device] if self.engine.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(row_seed(sampling.seed, row))
            sequences = self.engine.generate(prompt, torch.ones_like(prompt), do_sample=True,
                                             temperature=sampling.temperature, top_p=sampling.top_p,
                                             top_k=sampling.top_k, max_new_tokens=sampling.max_completion_length,
                                             eos_token_id=self.stop_ids, pad_token_id=self.pad_token_id)
        return completions_of(sequences, len(prompt_ids), self.stop_ids, self.pad_token_id)


def completions_of(sequences: torch.Tensor, prompt_length: int, stop_ids: list[int], pad_token_id: int
                   ) -> Completions:
    """The completions in generate's output rows, cut at their first stop token (padding after it)."""
    ids = sequences[:, prompt_length:]
    mask, truncated = completion_mask(ids, stop_ids)
    return Completions(ids.masked_fill(mask == 0, pad_token_id), mask, truncated)


def sampled_completions(out: Any, prompt_length: int, stop_ids: list[int], pad_token_id: int,
                        temperature: float) -> Completions:
    """The completions of a ``GenerateOutput`` (sequences and logits), with the sampler's log-probabilities."""
    done = completions_of(out.sequences, prompt_length, stop_ids, pad_token_id)
    logits = torch.stack(out.logits, dim=1).float() / temperature
    logps = torch.gather(logits.log_softmax(-1), -1, done.ids.unsqueeze(-1)).squeeze(-1) * done.mask
    return Completions(done.ids, done.mask, done.truncated, logps)
