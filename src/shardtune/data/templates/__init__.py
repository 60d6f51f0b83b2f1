"""Chat templates under LLaMA-Factory's names; see ``base`` for how a conversation is split into turns."""

from __future__ import annotations

from typing import Any

from shardtune.data.registry import did_you_mean
from shardtune.data.templates.auto import TokenizerChatTemplate
from shardtune.data.templates.base import Message, Template, Turn, special_token_strings
from shardtune.data.templates.families import TEMPLATES
from shardtune.data.templates.tools import TOOL_FORMATS
from shardtune.errors import DataError
from shardtune.paths import shown

# LLaMA-Factory template names of models shardtune cannot train, each with the reason.
REFUSED_TEMPLATES = {
    "moss_vl": "MOSS-VL is remote code (trust_remote_code) that transformers 5.23 does not include, so shardtune "
               "neither loads it nor reads its images; shardtune trains images with Qwen2-VL, Qwen2.5-VL, Qwen3-VL, "
               "Qwen3.5, Gemma 3 and Gemma 4 models (templates qwen2_vl, qwen3_vl, qwen3_5, gemma3, gemma4)",
}


def unknown_template_message(name: str) -> str:
    """The line shown for an unknown template name: the closest name, ``auto``, and every choice (or why a
    LLaMA-Factory name is not offered)."""
    if name in REFUSED_TEMPLATES:
        return f"template '{name}' is not offered: {REFUSED_TEMPLATES[name]}"
    return (f"unknown template {shown(name)}{did_you_mean(name, TEMPLATES)}; or use 'auto' for the tokenizer's own "
            f"chat_template; choose one of {', '.join(TEMPLATES)}")


def unknown_tool_format_message(tool_format: str) -> str:
    return (f"tool_format '{tool_format}' is not supported by shardtune{did_you_mean(tool_format, TOOL_FORMATS)}; "
            f"choose one of {', '.join(TOOL_FORMATS)}, or unset it to use the template's own")


def get_template(name: str, default_system: str | None = None, enable_thinking: bool = True,
                 tool_format: str | None = None) -> Template:
    """The template registered under ``name`` with the config's options; unknown names raise with a suggestion."""
    if name not in TEMPLATES:
        raise DataError(unknown_template_message(name))
    if tool_format is not None and tool_format not in TOOL_FORMATS:
        raise DataError(unknown_tool_format_message(tool_format))
    style = TOOL_FORMATS[tool_format] if tool_format is not None else None
    return TEMPLATES[name].with_options(default_system, enable_thinking, style)


def missing_special_tokens(template: Template, tokenizer: Any) -> list[str]:
    """Literal special tokens of ``template`` that the tokenizer would split into several ids."""
    vocab = tokenizer.get_vocab()
    return sorted(token for token in template.literal_special_tokens() if token not in vocab)


__all__ = [
    "TEMPLATES",
    "TOOL_FORMATS",
    "Message",
    "Template",
    "TokenizerChatTemplate",
    "Turn",
    "get_template",
    "missing_special_tokens",
    "special_token_strings",
    "unknown_template_message",
    "unknown_tool_format_message",
]
