"""A chat template: how a conversation becomes text, split into (prompt, response) pieces per turn.

Each turn is rendered as two strings so that the tokeniser can encode them separately and the
label mask falls exactly on the boundary: the prompt piece (prefix, system, user message or tool
result, and the assistant header) is masked, the response piece (answer or tool call plus the
end-of-turn token) is trained. ``{bos}``/``{eos}`` in a format stand for the tokenizer's own special
tokens; ``{content}`` for the text. The concatenated pieces equal what the family's official
``chat_template`` renders for the same conversation (tests compare with the jinja source).

Messages come in (ask, answer) pairs: ask is ``user`` or ``observation`` (a tool result; ``tool``
is accepted too), answer is ``assistant`` or ``function`` (a tool call whose content is the JSON
``{"name", "arguments"}`` or a list of them; ``function_call`` is accepted too).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardtune.data.templates.thinking import ThinkingStyle
from shardtune.data.templates.tools import ToolStyle, parse_tool_calls, parse_tools
from shardtune.errors import DataError

Message = dict[str, str]
Turn = tuple[str, str]  # (prompt text, response text)

ASK_ROLES = {"user": "user", "observation": "observation", "tool": "observation"}
ANSWER_ROLES = {"assistant": "assistant", "function": "function", "function_call": "function"}
SYSTEM_PLACEMENTS = ("block", "first_user", "last_user")
# <|im_end|>, DeepSeek's full-width <｜User｜>, Gemma 4's one-sided <|turn> and <turn|>
_SPECIAL_LITERAL = re.compile(r"<\|[A-Za-z_]+\|?>|<[A-Za-z_]+\|>|<｜[^｜<>]+｜>")


@dataclass(frozen=True)
class Template:
    """A fixed prompt format. ``user_format`` ends with the assistant header, so the answer follows it.

    ``system_placement``: ``block`` renders ``system_format`` once before the first turn; ``first_user``
    / ``last_user`` prepend it to that user message (families whose official template has no system
    role of its own). ``final_suffix`` follows only the last answer (e.g. Phi-3 closes with eos);
    ``last_assistant_format``, when set, replaces ``assistant_format`` for the last answer (gpt-oss ends
    it with ``<|return|>`` instead of ``<|end|>``).
    ``tool_style`` writes tool definitions, calls and results (see ``tools``); ``no_tools_reason`` says
    why a template has none. ``thinking`` writes the family's reasoning blocks (see ``thinking``): kept only
    after the last user query, with the family's rule for empty blocks and for where the prompt ends.
    ``closing_roles``: a family without an end-of-turn token ends an answer by generating the next turn's role
    token (GLM-4: ``<|user|>``, ``<|observation|>``), so that token is trained with the answer before it.
    ``document_end`` separates pre-training documents where the chat stop token (often the Instruct tokenizer's
    eos) is not what the base model saw there (Llama 3: ``<|end_of_text|>``, not ``<|eot_id|>``).
    """

    name: str
    user_format: str
    assistant_format: str
    system_format: str = "{content}"
    system_placement: str = "block"
    prefix: str = ""
    default_system: str = ""
    stop_word: str = "{eos}"
    strip_content: bool = False
    strip_system: bool = False  # the system prompt trimmed (Llama 3/4, Qwen3.5, Gemma 4; Command-R keeps it)
    final_suffix: str = ""
    last_assistant_format: str = ""
    tool_style: ToolStyle | None = None
    no_tools_reason: str = ""  # why there is no tool_style, shown when data with tools is refused
    thinking: ThinkingStyle | None = None
    enable_thinking: bool = True
    closing_roles: tuple[str, ...] = ()  # role tokens that also end the answer before them (GLM-4)
    document_end: str = "{eos}"  # what ends each pre-training document (pt)

    def render_turns(self, system: str, messages: Sequence[Message], tokenizer: Any, tools: str = ""
                     ) -> list[Turn]:
        """Render ``messages`` (ask/answer pairs) into one (prompt, response) pair per answer."""
        specials = special_token_strings(tokenizer)
        pairs = ask_answer_pairs(messages)
        tool_list = parse_tools(tools)
        self.require_tool_support(pairs, tool_list)
        system = system or self.default_system
        last_query = max((k for k, (ask, _) in enumerate(pairs) if ask["role"] == "user"), default=-1)
        turns = []
        for k, (ask, answer) in enumerate(pairs):
            head = self.render_head(system, tool_list, specials) if k == 0 else ""
            prompt = head + self.render_ask(ask, system, k, pairs, tool_list, specials)
            masked, think, content = self.split_thinking(answer, k, k >= last_query, k == len(pairs) - 1)
            response = think + fill(self.answer_format(answer, k == len(pairs) - 1), content, specials)
            if k == len(pairs) - 1:
                response += fill(self.final_suffix, "", specials)
            turns.append((prompt + masked, response))
        return self.close_with_roles(turns)

    def close_with_roles(self, turns: list[Turn]) -> list[Turn]:
        """Move a ``closing_roles`` token from the start of a turn's prompt to the end of the answer before it:
        the text is unchanged, but the token is trained where the model has to generate it to stop."""
        for k in range(1, len(turns)):
            prompt = turns[k][0]
            role = next((role for role in self.closing_roles if prompt.startswith(role)), "")
            if role:
                turns[k - 1] = (turns[k - 1][0], turns[k - 1][1] + role)
                turns[k] = (prompt[len(role):], turns[k][1])
        return turns

    def answer_format(self, answer: Message, is_last: bool) -> str:
        if answer["role"] == "function" and self.tool_style is not None and self.tool_style.call_format is not None:
            return self.tool_style.call_format
        return self.last_assistant_format if is_last and self.last_assistant_format else self.assistant_format

    def render_head(self, system: str, tools: list[dict[str, Any]], specials: dict[str, str]) -> str:
        head = fill(self.prefix, "", specials)
        block = self.tool_style.system_block(system, tools) if tools and self.tool_style is not None else None
        if block is not None:
            return head + block
        system = system.strip() if self.strip_system else system
        if self.thinking is not None and self.thinking.think_system and self.enable_thinking:
            return head + fill(self.system_format, self.thinking.think_system + system, specials)
        if system and self.system_placement == "block":
            head += fill(self.system_format, system, specials)
        return head

    def render_ask(self, ask: Message, system: str, index: int, pairs: list[tuple[Message, Message]],
                   tools: list[dict[str, Any]], specials: dict[str, str]) -> str:
        if ask["role"] == "observation":
            assert self.tool_style is not None, "require_tool_support runs first"
            previous = pairs[index - 1][1] if index > 0 else None
            call_count = len(parse_tool_calls(previous["content"])) if previous and previous["role"] == "function" \
                else 0
            return self.tool_style.result(ask["content"], index, call_count)  # data text: never filled
        content = ask["content"].strip() if self.strip_content else ask["content"]
        user_indices = [k for k, (message, _) in enumerate(pairs) if message["role"] == "user"]
        target = user_indices[0] if self.system_placement == "first_user" else user_indices[-1]
        if system and self.system_placement != "block" and index == target:
            content = fill(self.system_format, system, specials) + content
        if self.thinking is not None and not self.enable_thinking:
            suffix = self.thinking.no_think_user_suffix
            content += "" if content.endswith(suffix) else suffix
        before = ""
        if tools and self.tool_style is not None:
            is_first, is_last = index == user_indices[0], index == user_indices[-1]
            content = self.tool_style.user_content(content, tools, is_first, is_last)
            before = self.tool_style.before_user(tools, is_first, is_last)
        return before + fill(self.user_format, content, specials)

    def split_thinking(self, answer: Message, turn: int, after_query: bool, is_last: bool) -> tuple[str, str, str]:
        """(masked text after the assistant header, trained reasoning block, answer text) for one answer.

        Without ``thinking`` the first two are empty; with it, the family's rule applies (``thinking``).
        """
        if answer["role"] == "function":
            assert self.tool_style is not None, "require_tool_support runs first"
            content = self.tool_style.calls(parse_tool_calls(answer["content"]), turn)
        else:
            content = answer["content"].strip() if self.strip_content else answer["content"]
        if self.thinking is None:
            return "", "", content
        return self.thinking.pieces(content, after_query, is_last, self.enable_thinking)

    def require_tool_support(self, pairs: list[tuple[Message, Message]], tools: list[dict[str, Any]]) -> None:
        uses_tools = bool(tools) or any(ask["role"] == "observation" or answer["role"] == "function"
                                        for ask, answer in pairs)
        if uses_tools and self.tool_style is None:
            reason = self.no_tools_reason or "its official chat template defines no tool calling"
            raise DataError(f"template '{self.name}' has no tool-call format ({reason}), but the data has tools, "
                            "tool calls or tool results; use a template with tools (qwen, qwen3, qwen3_nothink, "
                            "qwen3_5, llama3, mistral, glm4, glm4_moe), template: auto (the tokenizer's own chat "
                            "template, tools included), set tool_format, or drop the tool columns")

    def with_options(self, default_system: str | None = None, enable_thinking: bool = True,
                     tool_style: ToolStyle | None = None) -> Template:
        """This template with the config's ``default_system``, ``enable_thinking`` and ``tool_format`` (a template
        fixed to no thinking, e.g. ``qwen3_5_nothink``, stays so)."""
        changes: dict[str, Any] = {"enable_thinking": enable_thinking and self.enable_thinking}
        if default_system is not None:
            changes["default_system"] = default_system
        if tool_style is not None:
            changes["tool_style"] = tool_style
        return dataclasses.replace(self, **changes)

    def validate(self, tokenizer: Any) -> None:
        """Raise DataError now if this template cannot work with ``tokenizer`` (checked before any map)."""
        special_token_strings(tokenizer)

    def stop_token(self, tokenizer: Any) -> str:
        """The token that ends an assistant turn (what generation should stop on)."""
        return fill(self.stop_word, "", special_token_strings(tokenizer))

    def literal_special_tokens(self) -> set[str]:
        """Special tokens such as ``<|im_end|>`` written literally in the formats."""
        text = (self.prefix + self.system_format + self.user_format + self.assistant_format + self.stop_word
                + self.final_suffix + self.last_assistant_format)
        if self.thinking is not None:
            text += self.thinking.block + self.thinking.think_system
        return set(_SPECIAL_LITERAL.findall(text))


def ask_answer_pairs(messages: Sequence[Message]) -> list[tuple[Message, Message]]:
    """Messages as (ask, answer) pairs with canonical role names; a broken order is a DataError."""
    pairs = []
    for index in range(0, len(messages) - 1, 2):
        ask, answer = messages[index], messages[index + 1]
        if ask["role"] not in ASK_ROLES or answer["role"] not in ANSWER_ROLES:
            raise DataError(f"message {index} ('{ask['role']}') and {index + 1} ('{answer['role']}') must be a "
                            f"question ({', '.join(ASK_ROLES)}) followed by an answer ({', '.join(ANSWER_ROLES)})")
        pairs.append(({"role": ASK_ROLES[ask["role"]], "content": ask["content"]},
                      {"role": ANSWER_ROLES[answer["role"]], "content": answer["content"]}))
    return pairs


def special_token_strings(tokenizer: Any) -> dict[str, str]:
    """Values for ``{bos}``/``{eos}``; a missing BOS is simply left out, a missing EOS is an error."""
    eos = getattr(tokenizer, "eos_token", None)
    if not eos:
        raise DataError("the tokenizer has no eos_token, so answers cannot be terminated; "
                        "set eos_token in the tokenizer config")
    return {"{bos}": getattr(tokenizer, "bos_token", None) or "", "{eos}": eos}


def fill(fmt: str, content: str, specials: dict[str, str]) -> str:
    """Substitute special tokens first, then the content, so text that contains "{eos}" stays literal."""
    for placeholder, token in specials.items():
        fmt = fmt.replace(placeholder, token)
    return fmt.replace("{content}", content)
