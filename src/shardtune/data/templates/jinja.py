"""A named template written as a Jinja ``chat_template``: what a saved tokenizer carries after training.

The Jinja text renders exactly what ``Template.render_turns`` renders for a conversation of system, user and
assistant messages (the pieces concatenated), with the special tokens the model was trained on written as literal
text: a later change of the tokenizer's ``eos_token`` (``replace_eos``) does not change the rendering. What the
Python template does is mirrored rule by rule: the default system prompt, where the system prompt goes, stripped
contents, the last answer's own format and final suffix, and the family's reasoning blocks (``thinking``: kept only
after the last user message, empty blocks by the family's rule; the generation prompt ends where training's prompt
ended: inside the block (Qwen3.5) or after an empty one (``enable_thinking=False``)). The assistant header is
part of a user turn in shardtune's templates, so it follows every user message, with or without
``add_generation_prompt``.

Tool definitions, tool calls and tool results are not written in Jinja: a conversation with them raises, naming
the template, instead of rendering something the model never saw.
"""

from __future__ import annotations

import json
from typing import Any

from shardtune.data.templates.base import Template, special_token_strings
from shardtune.data.templates.thinking import ThinkingStyle

SHOWN_EXPRESSIONS = {  # ThinkingStyle.is_shown in Jinja (``after``: the answer follows the last user message)
    "qwen3": "after and (loop.last or reasoning)",
    "after_query": "after",
    "every_answer": "true",
    "reasoning_only": "after and (reasoning or (loop.last and not thinking_on))",
}


def jinja_literal(text: str) -> str:
    """``text`` as a Jinja string literal (JSON's escapes are a subset of the ones Jinja reads)."""
    return json.dumps(text, ensure_ascii=False)


def chat_template_jinja(template: Template, tokenizer: Any, specials: dict[str, str] | None = None) -> str:
    """The Jinja ``chat_template`` that renders ``template`` for plain conversations with ``tokenizer``'s special
    tokens as they are now, or with ``specials`` (``{"{bos}": ..., "{eos}": ...}``: those training rendered, when
    the tokenizer's eos was replaced since)."""
    specials = specials or special_token_strings(tokenizer)

    def literal(fmt: str) -> str:
        for placeholder, token in specials.items():
            fmt = fmt.replace(placeholder, token)
        return fmt

    def filled(fmt: str, expression: str) -> str:
        before, found, after = literal(fmt).partition("{content}")
        if not found:
            return jinja_literal(before)
        return f"{jinja_literal(before)} + {expression} + {jinja_literal(after)}"

    def emit(expression: str) -> str:
        return "{{- " + expression + " -}}"

    strip = ".strip()" if template.strip_content else ""
    strip_system = ".strip()" if template.strip_system else ""
    thinking = template.thinking
    think_system = thinking.think_system if thinking is not None else ""
    last_format = template.last_assistant_format or template.assistant_format
    system_target = {"first_user": "ns.first_user", "last_user": "ns.last_user"}.get(template.system_placement)
    refusal = jinja_literal(f"shardtune's saved template '{template.name}' renders system, user and assistant "
                            "messages only; tools, tool calls and tool results are not part of it")
    parts = [
        "{%- if tools is defined and tools -%}" + emit(f"raise_exception({refusal})") + "{%- endif -%}",
        "{%- set thinking_on = enable_thinking if enable_thinking is defined else "
        + ("true" if template.enable_thinking else "false") + " -%}",
        "{%- set ns = namespace(system=" + jinja_literal(template.default_system)
        + ", start=0, first_user=-1, last_user=-1) -%}",
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set ns.system = messages[0]['content'] or ns.system -%}{%- set ns.start = 1 -%}{%- endif -%}",
        "{%- for message in messages -%}{%- if message['role'] == 'user' -%}"
        "{%- set ns.last_user = loop.index0 -%}{%- if ns.first_user < 0 -%}{%- set ns.first_user = loop.index0 -%}"
        "{%- endif -%}{%- elif message['role'] != 'assistant' and not (message['role'] == 'system' and loop.first) "
        "or message.get('tool_calls') -%}" + emit(f"raise_exception({refusal})") + "{%- endif -%}{%- endfor -%}",
        emit(jinja_literal(literal(template.prefix))),
    ]
    if think_system:
        parts.append("{%- if thinking_on -%}" + emit(filled(template.system_format, jinja_literal(think_system)
                                                               + " + ns.system" + strip_system))
                     + "{%- elif ns.system" + strip_system + " -%}"
                     + emit(filled(template.system_format, "ns.system" + strip_system))
                     + "{%- endif -%}")
    elif system_target is None:
        parts.append("{%- if ns.system" + strip_system + " -%}" + emit(filled(template.system_format,
                                                                               "ns.system" + strip_system))
                     + "{%- endif -%}")
    parts += [
        "{%- for message in messages[ns.start:] -%}{%- set index = loop.index0 + ns.start -%}",
        "{%- if message['role'] == 'user' -%}{%- set content = message['content']" + strip + " -%}",
    ]
    if system_target is not None:
        parts.append("{%- if ns.system and index == " + system_target + " -%}{%- set content = "
                     + filled(template.system_format, "ns.system") + " + content -%}{%- endif -%}")
    if thinking is not None and thinking.no_think_user_suffix:
        suffix = jinja_literal(thinking.no_think_user_suffix)
        parts.append("{%- if not thinking_on and not content.endswith(" + suffix + ") -%}{%- set content = content + "
                     + suffix + " -%}{%- endif -%}")
    parts.append(emit(filled(template.user_format, "content")))
    if thinking is not None:
        parts.append("{%- if loop.last and add_generation_prompt -%}{%- if thinking_on -%}"
                     + emit(jinja_literal(thinking.think_prompt)) + "{%- else -%}"
                     + emit(jinja_literal(thinking.empty_block())) + "{%- endif -%}{%- endif -%}")
    parts.append("{%- else -%}{%- set content = message['content']" + strip + " -%}{%- set think = '' -%}")
    if thinking is not None:
        parts.append(_thinking_jinja(thinking))
    parts += [
        "{%- if loop.last -%}" + emit("think + " + filled(last_format, "content") + " + "
                                      + jinja_literal(literal(template.final_suffix))),
        "{%- else -%}" + emit("think + " + filled(template.assistant_format, "content")) + "{%- endif -%}",
        "{%- endif -%}{%- endfor -%}",
    ]
    return "".join(parts)


def _thinking_jinja(style: ThinkingStyle) -> str:
    """``ThinkingStyle.pieces`` in Jinja: reasoning is split off the answer, dropped before the last user message
    (and with thinking off), and written as ``think`` by the family's rule."""
    close, open_ = jinja_literal(style.close_tag), jinja_literal(style.open_tag)
    trim = "{%- set reasoning = reasoning.strip() -%}{%- set content = content.strip() -%}" if style.strip \
        else "{%- set reasoning = reasoning.strip('\\n') -%}"
    before, _, after = style.block.partition("{reasoning}")
    return (
        "{%- set reasoning = '' -%}"
        "{%- if " + close + " in content -%}"
        "{%- set reasoning = content.split(" + close + ")[0].rstrip('\\n').split(" + open_ + ")[-1].lstrip('\\n') -%}"
        "{%- set content = content.split(" + close + ")[-1].lstrip('\\n') -%}{%- endif -%}" + trim +
        "{%- set after = index > ns.last_user -%}"
        "{%- if not (thinking_on and after) -%}{%- set reasoning = '' -%}{%- endif -%}"
        "{%- if " + SHOWN_EXPRESSIONS[style.shown] + " -%}"
        "{%- set think = " + jinja_literal(before) + " + reasoning + " + jinja_literal(after) + " -%}{%- endif -%}"
    )
