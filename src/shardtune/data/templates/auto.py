"""Template ``auto``: the tokenizer's own jinja ``chat_template``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardtune.data.templates.base import Message, Template, Turn, special_token_strings
from shardtune.errors import DataError

NAMED_INSTEAD = "set template to a named one (see `template` in docs/config.md)"


@dataclass(frozen=True)
class TokenizerChatTemplate(Template):
    """Turn boundaries are found by rendering growing prefixes of the conversation: the prompt piece
    of turn k is what the generation prompt adds after turn k-1, the response piece is what the
    assistant message adds after that.
    """

    name: str = "auto"
    user_format: str = ""
    assistant_format: str = ""

    def render_turns(self, system: str, messages: Sequence[Message], tokenizer: Any, tools: str = ""
                     ) -> list[Turn]:
        require_chat_template(tokenizer)
        if tools or any(m["role"] not in ("user", "assistant") for m in messages):
            raise DataError("template 'auto' handles user/assistant chats only; data with tools, tool calls or "
                            f"tool results needs a named template with a tool format, e.g. qwen; {NAMED_INSTEAD}")
        system = system or self.default_system
        head: list[Message] = [{"role": "system", "content": system}] if system else []
        turns, done = [], ""
        for index in range(0, len(messages) - 1, 2):
            with_prompt = render_chat(tokenizer, head + list(messages[: index + 1]), True, self.enable_thinking)
            full = render_chat(tokenizer, head + list(messages[: index + 2]), False, self.enable_thinking)
            if not (with_prompt.startswith(done) and full.startswith(with_prompt)):
                raise DataError(
                    "template 'auto': the tokenizer's chat_template renders earlier turns differently once later "
                    "turns are added (e.g. it drops reasoning), so prompt and answer cannot be separated; "
                    + NAMED_INSTEAD
                )
            turns.append((with_prompt[len(done) :], full[len(with_prompt) :]))
            done = full
        return turns

    def validate(self, tokenizer: Any) -> None:
        require_chat_template(tokenizer)
        special_token_strings(tokenizer)

    def stop_token(self, tokenizer: Any) -> str:
        return special_token_strings(tokenizer)["{eos}"]

    def literal_special_tokens(self) -> set[str]:
        return set()


def require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"template 'auto' needs the tokenizer's chat_template, but tokenizer '{name}' has none; "
                        + NAMED_INSTEAD)


def render_chat(tokenizer: Any, messages: list[Message], add_generation_prompt: bool, enable_thinking: bool
                ) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         enable_thinking=enable_thinking)
    assert isinstance(text, str), "apply_chat_template(tokenize=False) must return text"
    return text
