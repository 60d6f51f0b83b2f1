"""Reasoning blocks: how a family writes an answer's reasoning, and which answers show one.

The data carries reasoning inside the answer text, between the family's markers (``<think>...</think>``, as
LLaMA-Factory's thought words). Every official template drops the reasoning of answers before the last user
query; they differ in what else they write:

- ``qwen3``: after the last query, a block when the answer has reasoning or is the final one (empty then).
- ``after_query``: every answer after the last query shows a block, empty or not (Qwen3.5, DeepSeek-R1).
- ``every_answer``: every answer shows a block; before the last query an empty one (GLM-4.5).
- ``reasoning_only``: a block only where there is reasoning after the last query (Gemma 4); with thinking off
  the final answer follows the empty block the official generation prompt ends with.

``think_prompt`` is where the official generation prompt stops inside the block when thinking is on (Qwen3.5
ends it with ``<think>\\n``): that part is masked with the prompt, the rest is trained. With thinking off, the
reasoning is dropped and the empty block (``block`` without reasoning, what the official no-think generation
prompt ends with) is masked with the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

SHOWN_RULES = ("qwen3", "after_query", "every_answer", "reasoning_only")


@dataclass(frozen=True)
class ThinkingStyle:
    """One family's reasoning block. ``block`` holds ``{reasoning}``; ``strip`` trims reasoning and answer
    entirely (Qwen3.5, GLM-4.5) instead of only the newlines next to the markers (Qwen3)."""

    name: str
    shown: str = "qwen3"
    block: str = "<think>\n{reasoning}\n</think>\n\n"
    open_tag: str = "<think>"
    close_tag: str = "</think>"
    think_prompt: str = ""
    strip: bool = False
    no_think_user_suffix: str = ""  # GLM-4.5 appends "/nothink" to each user message when thinking is off
    think_system: str = ""  # Gemma 4 opens the system turn with "<|think|>" when thinking is on

    def __post_init__(self) -> None:
        assert self.shown in SHOWN_RULES, self.shown
        assert self.block.startswith(self.think_prompt), "the generation prompt stops inside the block"

    def empty_block(self) -> str:
        return self.block.replace("{reasoning}", "")

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of an answer text, as the official templates split it."""
        if self.close_tag not in text:
            return "", text.strip() if self.strip else text
        reasoning = text.split(self.close_tag)[0].rstrip("\n").split(self.open_tag)[-1].lstrip("\n")
        answer = text.split(self.close_tag)[-1].lstrip("\n")
        if self.strip:
            return reasoning.strip(), answer.strip()
        return reasoning.strip("\n"), answer

    def is_shown(self, reasoning: str, after_query: bool, is_last: bool, enable_thinking: bool) -> bool:
        """Whether an answer is written with a block (with ``reasoning`` already dropped where it must be)."""
        if self.shown == "every_answer":
            return True
        if not after_query:
            return False
        if self.shown == "after_query":
            return True
        if self.shown == "qwen3":
            return is_last or bool(reasoning)
        return bool(reasoning) or (is_last and not enable_thinking)

    def pieces(self, text: str, after_query: bool, is_last: bool, enable_thinking: bool) -> tuple[str, str, str]:
        """(masked text after the assistant header, trained block text, answer) for one answer."""
        reasoning, answer = self.split(text)
        if not (enable_thinking and after_query):
            reasoning = ""
        if not self.is_shown(reasoning, after_query, is_last, enable_thinking):
            return "", "", answer
        if not enable_thinking and after_query:
            return self.empty_block(), "", answer
        written = self.block.replace("{reasoning}", reasoning)
        if after_query:
            return self.think_prompt, written[len(self.think_prompt):], answer
        return "", written, answer


QWEN3_THINKING = ThinkingStyle("qwen3")
QWEN3_5_THINKING = ThinkingStyle("qwen3_5", shown="after_query", think_prompt="<think>\n", strip=True)
# Qwen3-VL-Thinking (as Qwen3-Thinking-2507): Qwen3's rule, the generation prompt opens the block.
QWEN3_VL_THINKING = ThinkingStyle("qwen3_vl", think_prompt="<think>\n")
GLM4_MOE_THINKING = ThinkingStyle("glm4_moe", shown="every_answer", block="\n<think>{reasoning}</think>", strip=True,
                                  no_think_user_suffix="/nothink")
GEMMA4_THINKING = ThinkingStyle("gemma4", shown="reasoning_only", block="<|channel>thought\n{reasoning}<channel|>",
                                open_tag="<|channel>thought", close_tag="<channel|>", think_system="<|think|>")
# DeepSeek-R1: every answer after the last query shows a block (its generation prompt always opens one).
DEEPSEEK_R1_THINKING = ThinkingStyle("deepseekr1", shown="after_query", think_prompt="<think>\n")
