"""Reward functions the stage grpo tests name in reward_funcs (module:function), each for one behaviour."""

from __future__ import annotations

from typing import Any

NOT_A_FUNCTION = 3


def letter_share(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """The share of a completion's characters that are the letter 'a' (a dense toy reward a tiny model can learn)."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def length_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def needs_answer(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    return [float(a in c) for c, a in zip(completions, answer, strict=True)]


def raises(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    raise ValueError("this reward always fails")


def one_short(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [0.0] * (len(completions) - 1)
