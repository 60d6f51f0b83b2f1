"""template: auto with tools: the tokenizer's own chat_template renders tool definitions, calls and results, the
prompt/answer boundaries found from its generation prompts (data/templates/auto.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from shardtune.data.templates import get_template
from shardtune.errors import DataError
from tests.unit.conftest_data import build_test_tokenizer
from tests.unit.test_templates_lf import (
    FIXTURES,
    PARALLEL_CHAT,
    SYSTEM,
    TOOL_CHAT,
    TOOL_MULTI,
    TOOLS,
    WRAPPED_TOOLS,
    joined,
    official,
    openai_messages,
)

# Families whose official template renders a conversation's earlier turns the same once later turns are added
# (Qwen3 and Mistral do not: reasoning dropped, tools written before the last user message).
FAMILIES = ["gemma4", "llama4", "glm4_moe", "qwen2_5", "deepseek3", "phi4"]
CHATS = {"single": (TOOL_CHAT, ["000001000"]), "multi": (TOOL_MULTI, ["000002000"]),
         "parallel": (PARALLEL_CHAT, ["000001000", "000001001"])}


def tokenizer_with(fixture: str) -> Any:
    tokenizer = copy.deepcopy(build_test_tokenizer())  # the shared one (cached per process) keeps its template
    tokenizer.chat_template = (FIXTURES / f"{fixture}.jinja").read_text()
    return tokenizer


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("fixture", FAMILIES)
def test_auto_renders_a_tool_chat_as_the_official_template(fixture: str, chat: str) -> None:
    tokenizer = tokenizer_with(fixture)
    messages, call_ids = CHATS[chat]
    turns = get_template("auto").render_turns(SYSTEM, messages, tokenizer, json.dumps(TOOLS))
    assert joined(turns) == official(fixture, openai_messages(messages, call_ids), tokenizer, SYSTEM,
                                     tools=WRAPPED_TOOLS)
    for k in range(len(turns)):  # each prompt (masked) ends where the official generation prompt ends
        generation = official(fixture, openai_messages(messages[: 2 * k + 1], call_ids), tokenizer, SYSTEM,
                              tools=WRAPPED_TOOLS, add_generation_prompt=True)
        assert joined(turns[:k]) + turns[k][0] == generation
        assert turns[k][1]  # the answer is trained


def test_a_conversation_the_template_refuses_is_one_data_error() -> None:
    with pytest.raises(DataError, match=r"template 'auto': the tokenizer's chat_template refuses this conversation "
                                        r"\(This model only supports single tool-calls at once!\)"):
        get_template("auto").render_turns("", PARALLEL_CHAT, tokenizer_with("llama3_1"), json.dumps(TOOLS))


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_reason() -> None:
    with pytest.raises(DataError, match="renders earlier turns differently once later turns are added"):
        get_template("auto").render_turns(SYSTEM, TOOL_MULTI, tokenizer_with("mistral"), json.dumps(TOOLS))
