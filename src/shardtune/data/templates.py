"""Chat templates: how a conversation becomes text, split into (prompt, response) pieces per turn.

Each turn is rendered as two strings so that the tokeniser can encode them separately and the
label mask falls exactly on the boundary: the prompt piece (prefix, system, user message and the
assistant header) is masked, the response piece (answer plus the end-of-turn token) is trained.
``{bos}``/``{eos}`` in a format stand for the tokenizer's own special tokens; ``{content}`` for the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardtune.data.registry import did_you_mean
from shardtune.errors import DataError

Message = dict[str, str]
Turn = tuple[str, str]  # (prompt text, response text)

_SPECIAL_LITERAL = re.compile(r"<\|[A-Za-z_]+\|>")


@dataclass(frozen=True)
class Template:
    """A fixed prompt format. ``user_format`` ends with the assistant header, so the answer follows it."""

    name: str
    user_format: str
    assistant_format: str
    system_format: str = "{content}"
    prefix: str = ""
    default_system: str = ""
    stop_word: str = "{eos}"

    def render_turns(self, system: str, messages: Sequence[Message], tokenizer: Any) -> list[Turn]:
        """Render alternating user/assistant ``messages`` into one (prompt, response) pair per turn."""
        specials = special_token_strings(tokenizer)
        system = system or self.default_system
        head = fill(self.prefix, "", specials) + (fill(self.system_format, system, specials) if system else "")
        turns = []
        for index in range(0, len(messages) - 1, 2):
            prompt = fill(self.user_format, messages[index]["content"], specials)
            response = fill(self.assistant_format, messages[index + 1]["content"], specials)
            turns.append((head + prompt if index == 0 else prompt, response))
        return turns

    def validate(self, tokenizer: Any) -> None:
        """Raise DataError now if this template cannot work with ``tokenizer`` (checked before any map)."""
        special_token_strings(tokenizer)

    def stop_token(self, tokenizer: Any) -> str:
        """The token that ends an assistant turn (what generation should stop on)."""
        return fill(self.stop_word, "", special_token_strings(tokenizer))

    def literal_special_tokens(self) -> set[str]:
        """Special tokens such as ``<|im_end|>`` written literally in the formats."""
        text = self.prefix + self.system_format + self.user_format + self.assistant_format + self.stop_word
        return set(_SPECIAL_LITERAL.findall(text))


@dataclass(frozen=True)
class TokenizerChatTemplate(Template):
    """Template ``auto``: the tokenizer's own jinja ``chat_template``.

    Turn boundaries are found by rendering growing prefixes of the conversation: the prompt piece
    of turn k is what the generation prompt adds after turn k-1, the response piece is what the
    assistant message adds after that.
    """

    name: str = "auto"
    user_format: str = ""
    assistant_format: str = ""

    def render_turns(self, system: str, messages: Sequence[Message], tokenizer: Any) -> list[Turn]:
        require_chat_template(tokenizer)
        head: list[Message] = [{"role": "system", "content": system}] if system else []
        turns, done = [], ""
        for index in range(0, len(messages) - 1, 2):
            with_prompt = render_chat(tokenizer, head + list(messages[: index + 1]), add_generation_prompt=True)
            full = render_chat(tokenizer, head + list(messages[: index + 2]), add_generation_prompt=False)
            if not (with_prompt.startswith(done) and full.startswith(with_prompt)):
                raise DataError(
                    "template 'auto': the tokenizer's chat_template renders earlier turns differently once later "
                    "turns are added (e.g. it drops reasoning), so prompt and answer cannot be separated; "
                    "set template to one of " + ", ".join(name for name in TEMPLATES if name != "auto")
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


def require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"template 'auto' needs the tokenizer's chat_template, but tokenizer '{name}' has none; "
                        "set template to one of " + ", ".join(n for n in TEMPLATES if n != "auto"))


def render_chat(tokenizer: Any, messages: list[Message], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert isinstance(text, str), "apply_chat_template(tokenize=False) must return text"
    return text


_CHATML: dict[str, str] = {
    "system_format": "<|im_start|>system\n{content}<|im_end|>\n",
    "user_format": "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
    "assistant_format": "{content}<|im_end|>\n",
    "stop_word": "<|im_end|>",
}

TEMPLATES: dict[str, Template] = {
    "default": Template(
        name="default",
        prefix="{bos}",
        system_format="System: {content}\n",
        user_format="Human: {content}\nAssistant:",
        # The space starts the answer so that " word" tokenises as it would in running text.
        assistant_format=" {content}{eos}\n",
    ),
    "alpaca": Template(
        name="alpaca",
        prefix="{bos}",
        system_format="{content}\n\n",
        default_system="Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.",
        user_format="### Instruction:\n{content}\n\n### Response:\n",
        assistant_format="{content}{eos}\n\n",
    ),
    "chatml": Template(name="chatml", **_CHATML),
    "qwen": Template(name="qwen", default_system="You are a helpful assistant.", **_CHATML),
    "llama3": Template(
        name="llama3",
        prefix="<|begin_of_text|>",
        system_format="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
        user_format="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        assistant_format="{content}<|eot_id|>",
        stop_word="<|eot_id|>",
    ),
    "auto": TokenizerChatTemplate(),
}


def get_template(name: str) -> Template:
    """The template registered under ``name``; unknown names raise with a suggestion."""
    if name not in TEMPLATES:
        raise DataError(f"unknown template '{name}'{did_you_mean(name, TEMPLATES)}; "
                        f"choose one of {', '.join(TEMPLATES)}")
    return TEMPLATES[name]


def missing_special_tokens(template: Template, tokenizer: Any) -> list[str]:
    """Literal special tokens of ``template`` that the tokenizer would split into several ids."""
    vocab = tokenizer.get_vocab()
    return sorted(token for token in template.literal_special_tokens() if token not in vocab)
