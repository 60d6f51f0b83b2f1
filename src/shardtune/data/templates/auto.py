"""Template ``auto``: the tokenizer's own jinja ``chat_template``, tool definitions, calls and results included."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardtune.data.templates.base import Message, Template, Turn, ask_answer_pairs, special_token_strings
from shardtune.data.templates.tools import (
    ToolList,
    arguments_object,
    mistral_call_id,
    parse_tool_calls,
    parse_tools,
    results_per_call,
)
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
        tool_list = parse_tools(tools)
        system = system or self.default_system
        done_messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        turns, done = [], ""
        for asks, answer in chat_messages(ask_answer_pairs(messages)):
            with_prompt = render_chat(tokenizer, done_messages + asks, True, self.enable_thinking, tool_list)
            full = render_chat(tokenizer, done_messages + asks + [answer], False, self.enable_thinking, tool_list)
            if not (with_prompt.startswith(done) and full.startswith(with_prompt)):
                raise DataError(
                    "template 'auto': the tokenizer's chat_template renders earlier turns differently once later "
                    "turns are added (e.g. it drops reasoning), so prompt and answer cannot be separated; "
                    + NAMED_INSTEAD
                )
            turns.append((with_prompt[len(done) :], full[len(with_prompt) :]))
            done, done_messages = full, done_messages + asks + [answer]
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


def chat_messages(pairs: list[tuple[Message, Message]]) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """LLaMA-Factory's (ask, answer) pairs as the messages chat templates read (OpenAI's shape): a tool call is an
    assistant message with ``tool_calls``, a tool result a ``tool`` message answering one call (a turn of several
    calls takes its results as a JSON list, one per call). Call ids follow ``mistral_call_id`` (9 characters, as
    Mistral's templates require): the pair's index, then the call's."""
    converted: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
    pending: list[str] = []
    for turn, (ask, answer) in enumerate(pairs):
        if ask["role"] == "observation":
            results = results_per_call(ask["content"], len(pending))
            asks = [{"role": "tool", "content": text, "tool_call_id": call_id}
                    for text, call_id in zip(results, pending or [mistral_call_id(turn, 0)], strict=False)]
        else:
            asks = [{"role": "user", "content": ask["content"]}]
        pending = []
        if answer["role"] == "function":
            calls = parse_tool_calls(answer["content"])
            pending = [mistral_call_id(turn, index) for index in range(len(calls))]
            tool_calls = [{"id": call_id, "type": "function",
                           "function": {"name": call["name"], "arguments": arguments_object(call)}}
                          for call, call_id in zip(calls, pending, strict=True)]
            converted.append((asks, {"role": "assistant", "content": "", "tool_calls": tool_calls}))
        else:
            converted.append((asks, {"role": "assistant", "content": answer["content"]}))
    return converted


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, enable_thinking: bool,
                tools: ToolList | None = None) -> str:
    from jinja2.exceptions import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking, tools=tools or None)
    except TemplateError as err:  # the template's own raise_exception: a conversation it does not take
        raise DataError(f"template 'auto': the tokenizer's chat_template refuses this conversation ({err}); "
                        + NAMED_INSTEAD) from None
    assert isinstance(text, str), "apply_chat_template(tokenize=False) must return text"
    return text
