"""Scoring stage grpo's completions with the reward functions of ``reward_funcs`` (config/rewards.py resolves them).

A function is called once per group with the prompt (as text, template applied) repeated for each completion, the
completions as text, and each of the row's columns repeated likewise as keyword arguments; it returns one number per
completion. One that raises, returns another count or something that is not a number stops the run with a line
naming the function and the data row (ConfigError: the user's function, not shardtune, went wrong).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtune.config.rewards import RewardFunction, is_reward_model_folder, load_reward_function, reward_weights
from shardtune.errors import ConfigError
from shardtune.train.reward_model_scorer import RewardModelScorer


@dataclass(frozen=True)
class RewardSet:
    names: tuple[str, ...]
    functions: tuple[RewardFunction | RewardModelScorer, ...]
    weights: tuple[float, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        """Each function's name as the logs show it (TRL's: the function's own name)."""
        return tuple(spec.rpartition(":")[2] if ":" in spec else Path(spec).name for spec in self.names)

    @classmethod
    def load(cls, specs: list[str], weights: list[str] | None, format_regex: str | None,
             device: torch.device | None = None, tokenizer: Any = None) -> RewardSet:
        """The functions of ``specs``; a reward model folder is loaded on ``device`` (it scores ``tokenizer``'s
        ids)."""
        functions = tuple(_reward_model(spec, device, tokenizer) if is_reward_model_folder(spec)
                          else load_reward_function(spec, format_regex) for spec in specs)
        return cls(tuple(specs), functions, tuple(reward_weights(weights, len(specs))))

    def score(self, prompt: str, completions: list[str], columns: dict[str, Any], row: int,
              token_rows: list[list[int]]) -> torch.Tensor:
        """(completions, functions): each function's rewards for one group (``token_rows``: prompt + completion ids,
        what a reward model scores)."""
        n = len(completions)
        repeated = {key: [value] * n for key, value in columns.items()}
        table = [self._call(i, prompt, completions, repeated, row, token_rows) for i in range(len(self.functions))]
        return torch.tensor(table, dtype=torch.float32).T.reshape(n, len(self.functions))

    def _call(self, i: int, prompt: str, completions: list[str], columns: dict[str, list[Any]], row: int,
              token_rows: list[list[int]]) -> list[float]:
        name, function = self.names[i], self.functions[i]
        if isinstance(function, RewardModelScorer):
            return function.score(token_rows)
        try:
            values = function([prompt] * len(completions), completions, **columns)
        except Exception as err:  # the user's function: its own error, with where it happened
            raise ConfigError(f"reward_funcs ({name}) raised {type(err).__name__}: {err} on data row {row}") from None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ConfigError(f"reward_funcs ({name}) returned {count} values for the {len(completions)} completions "
                              f"of data row {row}; return one number per completion")
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            raise ConfigError(f"reward_funcs ({name}) returned {bad[0]!r} for data row {row}; return finite numbers")
        return [float(v) for v in values]

    def combined(self, table: torch.Tensor) -> torch.Tensor:
        """The weighted sum over functions of each completion's rewards."""
        return table @ torch.tensor(self.weights, dtype=table.dtype)


def _reward_model(folder: str, device: torch.device | None, tokenizer: Any) -> RewardModelScorer:
    if device is None or tokenizer is None:
        raise RuntimeError("a reward model folder needs the device and the policy's tokenizer")
    return RewardModelScorer(folder, device, tokenizer)
