"""Reward functions for examples/grpo/*.yaml, named there as ``examples/grpo/rewards.py:FUNCTION`` (a path relative
to the folder the run starts in; a dotted ``module:function`` on the Python path works too).

A reward function gets the prompts (the template applied, as text), the completions (as text, special tokens left
out) and every column of the rows as keyword arguments, one list entry per completion, and returns one number per
completion. Accept ``**kwargs`` so that columns you do not read do not break it.
"""

from __future__ import annotations

from typing import Any


def letter_share(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """The share of a completion's characters that are the letter 'a': a dense toy reward that a tiny random model
    learns within a few dozen CPU steps."""
    return [completion.count("a") / max(len(completion), 1) for completion in completions]


def answer_length(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 for a completion as long as the row's answer column, less the further it is (reads a data column)."""
    return [1.0 / (1.0 + abs(len(c.strip()) - len(a))) for c, a in zip(completions, answer, strict=True)]
