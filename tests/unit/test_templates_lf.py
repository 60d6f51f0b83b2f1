"""LLaMA-Factory template names: our text against the official jinja templates and hand-checked strings.

The fixtures in fixtures/chat_templates/ are the families' official ``chat_template`` sources; they are
rendered with transformers' ``apply_chat_template`` so the expected text does not come from our code.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from transformers.utils import chat_template_utils

from shardtune.data.processing import SftOptions, encode_sft_batch
from shardtune.data.settings import IGNORE_INDEX
from shardtune.data.templates import TEMPLATES, get_template, missing_special_tokens
from shardtune.errors import DataError
from tests.unit.conftest_data import build_test_tokenizer, expected_ids_and_labels

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
SYSTEM, Q1, A1, Q2, A2 = "Be brief.", "What is 2+2?", "4", "And 3+3?", "It is 6."
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SINGLE = [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1}]
MULTI = SINGLE + [{"role": "user", "content": Q2}, {"role": "assistant", "content": A2}]
TOOLS = [{"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}]
CALL = {"name": "add", "arguments": {"a": 3, "b": 3}}
TOOL_CHAT = [{"role": "user", "content": Q2}, {"role": "function", "content": json.dumps(CALL)},
             {"role": "observation", "content": "6"}, {"role": "assistant", "content": A2}]
TOOL_MULTI = MULTI[:2] + TOOL_CHAT  # a plain turn, then a tool call, its result and the answer
GPT_OSS_DATE = "2025-08-05"
# (template, fixture, how the official template takes a system prompt: "text", "parts" (a list of text parts),
# or None when it rejects one). Sources of the fixtures: fixtures/chat_templates/README.md.
OFFICIAL = [("qwen", "qwen2_5", "text"), ("qwen3", "qwen3", "text"), ("llama3", "llama3", "text"),
            ("gemma", "gemma", None), ("gemma3", "gemma3", "parts"), ("llama2", "llama2", "text"),
            ("phi", "phi3", "text"), ("phi4", "phi4", "text"), ("deepseek", "deepseek", "text"),
            ("deepseek3", "deepseek3", "text"), ("glm4", "glm4", "text"), ("cohere", "cohere", "text"),
            ("intern2", "intern2", "text"), ("yi", "yi", "text"), ("llama4", "llama4", "text"),
            ("gpt_oss", "gpt_oss", "text"), ("qwen3_5", "qwen3_5", "text"), ("qwen2_vl", "qwen2_vl", "text"),
            ("glm4_moe", "glm4_moe", "text"), ("gemma4", "gemma4", "text"), ("zephyr", "zephyr", "text"),
            ("deepseekr1", "deepseekr1", "text")]
# Keyword arguments that pin what an official template would take from the clock, and Gemma 4's thinking switch
# (on, as shardtune's enable_thinking default; the model's own default is off).
FIXED_INPUTS: dict[str, dict[str, Any]] = {"llama3_1": {"date_string": "26 Jul 2024"},
                                           "gemma4": {"enable_thinking": True}}
# Families whose official history drops the think block that their generation prompt opens: only the prompt of
# an answer after the last user query is the generation prompt (earlier ones are what the full rendering shows).
OPENER_ONLY_AFTER_QUERY = {"qwen3_5", "deepseekr1"}
R1_ASSISTANT = "<｜Assistant｜>"


class PinnedClock(datetime):
    """gpt-oss's template calls strftime_now(); transformers' version reads datetime.now()."""

    @classmethod
    def now(cls, tz: Any = None) -> PinnedClock:
        return cls.fromisoformat(GPT_OSS_DATE)


@pytest.fixture(autouse=True)
def pinned_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template_utils, "datetime", PinnedClock)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


def ours(name: str, messages: list[dict[str, str]], tokenizer: Any, system: str = "", tools: str = "",
         **options: Any) -> list[tuple[str, str]]:
    return get_template(name, **options).render_turns(system, messages, tokenizer, tools)


def official(fixture: str, messages: list[dict[str, Any]], tokenizer: Any, system: str = "",
             system_as: str = "text", **kwargs: Any) -> str:
    content: Any = [{"type": "text", "text": system}] if system_as == "parts" else system
    head = [{"role": "system", "content": content}] if system else []
    text = tokenizer.apply_chat_template(head + messages, chat_template=(FIXTURES / f"{fixture}.jinja").read_text(),
                                         tokenize=False, **{**FIXED_INPUTS.get(fixture, {}), **kwargs})
    assert isinstance(text, str)
    return text


def joined(turns: list[tuple[str, str]]) -> str:
    return "".join(prompt + response for prompt, response in turns)


def deliberate(name: str, official_text: str) -> str:
    """The official text with the differences documented on the template (see families.py)."""
    if name in ("glm4", "glm4_moe"):  # GLM ends the last answer with eos so that training teaches stopping
        return official_text + EOS
    if name == "deepseekr1":  # the last answer carries the (empty) think block its generation prompt opens
        head, _, last = official_text.rpartition(R1_ASSISTANT)
        return f"{head}{R1_ASSISTANT}<think>\n\n</think>\n\n{last}"
    return official_text


@pytest.mark.parametrize(("name", "fixture", "system_as"), OFFICIAL)
@pytest.mark.parametrize("chat", ["single", "multi", "system"])
def test_text_equals_the_official_template(tokenizer: Any, name: str, fixture: str, system_as: str | None,
                                           chat: str) -> None:
    if chat == "system" and system_as is None:
        with pytest.raises(Exception, match="System role not supported"):
            official(fixture, SINGLE, tokenizer, SYSTEM)
        return
    messages = SINGLE if chat == "single" else MULTI
    system = SYSTEM if chat == "system" else ""
    expected = official(fixture, messages, tokenizer, system, system_as or "text")
    assert joined(ours(name, messages, tokenizer, system)) == deliberate(name, expected)


@pytest.mark.parametrize(("name", "fixture", "system_as"), OFFICIAL)
def test_every_prompt_piece_is_the_official_generation_prompt(tokenizer: Any, name: str, fixture: str,
                                                              system_as: str | None) -> None:
    """The masked/trained boundary sits where the official template ends its generation prompt."""
    turns = ours(name, MULTI, tokenizer)
    for k in range(len(turns) - 1 if name in OPENER_ONLY_AFTER_QUERY else 0, len(turns)):
        prompt_text = joined(turns[:k]) + turns[k][0]
        assert prompt_text == official(fixture, MULTI[: 2 * k + 1], tokenizer, add_generation_prompt=True)


def openai_messages(chat: list[dict[str, str]], call_ids: list[str] | None = None) -> list[dict[str, Any]]:
    """LLaMA-Factory's function/observation roles as the official templates take them.

    ``call_ids`` are given to the calls in order (Mistral requires them); a result that follows several
    calls is a JSON list, one tool message per call.
    """
    ids = iter(call_ids or [])
    converted: list[dict[str, Any]] = []
    pending: list[str] = []
    for message in chat:
        if message["role"] == "function":
            listed = json.loads(message["content"])
            calls = [{"type": "function", "function": call} for call in (listed if isinstance(listed, list)
                                                                         else [listed])]
            if call_ids is not None:
                for call in calls:
                    call["id"] = next(ids)
            pending = [call.get("id", "") for call in calls]
            converted.append({"role": "assistant", "content": "", "tool_calls": calls})
        elif message["role"] == "observation":
            results = json.loads(message["content"]) if len(pending) > 1 else [message["content"]]
            converted += [{"role": "tool", "content": result, "tool_call_id": call_id}
                          for result, call_id in zip(results, pending, strict=True)]
        else:
            converted.append(message)
    return converted


@pytest.mark.parametrize(("name", "fixture"), [("qwen", "qwen2_5"), ("qwen3", "qwen3"), ("qwen3_nothink", "qwen2_5"),
                                             ("qwen3_5", "qwen3_5"), ("qwen3_5_nothink", "qwen3_5")])
@pytest.mark.parametrize("system", ["", SYSTEM])
def test_tool_calls_and_results_equal_the_official_template(tokenizer: Any, name: str, fixture: str,
                                                            system: str) -> None:
    tools = [{"type": "function", "function": tool} for tool in TOOLS]
    thinking = {"enable_thinking": False} if name == "qwen3_5_nothink" else {}
    expected = official(fixture, openai_messages(TOOL_CHAT), tokenizer, system, tools=tools, **thinking)
    if name == "qwen3_nothink":  # Qwen2.5's layout without its default system prompt
        expected = expected.replace("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n", "")
    assert joined(ours(name, TOOL_CHAT, tokenizer, system, json.dumps(TOOLS))) == expected


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_nothink"])
def test_qwen3_5_tool_prompt_pieces_are_the_official_generation_prompts(tokenizer: Any, name: str) -> None:
    tools = [{"type": "function", "function": tool} for tool in TOOLS]
    turns = ours(name, TOOL_CHAT, tokenizer, SYSTEM, json.dumps(TOOLS))
    thinking = {"enable_thinking": False} if name == "qwen3_5_nothink" else {}
    for k in range(len(turns)):
        assert joined(turns[:k]) + turns[k][0] == official(
            "qwen3_5", openai_messages(TOOL_CHAT[: 2 * k + 1]), tokenizer, SYSTEM, tools=tools,
            add_generation_prompt=True, **thinking)
    assert turns[0][1] == ("\n</think>\n\n<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n"
                           "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
                           if name == "qwen3_5" else
                           "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\n3\n"
                           "</parameter>\n</function>\n</tool_call><|im_end|>\n")


def test_qwen_tool_call_text_by_hand(tokenizer: Any) -> None:
    turns = ours("qwen3", TOOL_CHAT, tokenizer)
    assert turns[0] == (f"<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n",
                        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 3}}\n</tool_call><|im_end|>\n')
    assert turns[1] == ("<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                        f"<think>\n\n</think>\n\n{A2}<|im_end|>\n")


# Tool formats beyond Qwen: (template, fixture). Sources of the fixtures: fixtures/chat_templates/README.md.
TOOL_FAMILIES = [("llama3", "llama3_1"), ("mistral", "mistral"), ("glm4", "glm4")]
WRAPPED_TOOLS = [{"type": "function", "function": tool} for tool in TOOLS]
# Mistral's call ids are shardtune's documented scheme (tools.mistral_call_id): pair index, then call index.
MISTRAL_IDS = {"single": ["000000000"], "multi": ["000001000"]}


def glm4_messages(chat: list[dict[str, str]], system: str) -> list[dict[str, Any]]:
    """GLM-4's own message shape: tools on the system message, a call as metadata (name) + arguments JSON."""
    converted: list[dict[str, Any]] = [{"role": "system", "content": system, "tools": WRAPPED_TOOLS}]
    for message in chat:
        if message["role"] == "function":
            call = json.loads(message["content"])
            converted.append({"role": "assistant", "metadata": call["name"],
                              "content": json.dumps(call["arguments"], ensure_ascii=False)})
        else:
            converted.append(message)
    return converted


def official_tool_chat(name: str, chat: list[dict[str, str]], tokenizer: Any, system: str, ids: list[str],
                       **kwargs: Any) -> str:
    fixture = dict(TOOL_FAMILIES)[name]
    if name == "glm4":
        return official(fixture, glm4_messages(chat, system), tokenizer, **kwargs)
    return official(fixture, openai_messages(chat, ids if name == "mistral" else None), tokenizer, system,
                    tools=WRAPPED_TOOLS, **kwargs)


@pytest.mark.parametrize(("name", "fixture"), TOOL_FAMILIES)
@pytest.mark.parametrize("chat", ["single", "multi"])
@pytest.mark.parametrize("system", ["", SYSTEM])
def test_tool_formats_equal_the_official_template(tokenizer: Any, name: str, fixture: str, chat: str,
                                                  system: str) -> None:
    """Tool definitions, a call, its result and the final answer, as the official template writes them."""
    if name == "mistral" and system:
        pytest.skip("the official v0.3 template drops the system prompt unless the last message is the user's "
                    "(see test_mistral_tool_prompt_with_system_equals_the_official_generation_prompt)")
    messages = TOOL_CHAT if chat == "single" else TOOL_MULTI
    expected = official_tool_chat(name, messages, tokenizer, system, MISTRAL_IDS[chat])
    assert joined(ours(name, messages, tokenizer, system, json.dumps(TOOLS))) == deliberate(name, expected)


@pytest.mark.parametrize("name", ["llama3", "glm4"])
def test_tool_prompt_pieces_are_the_official_generation_prompts(tokenizer: Any, name: str) -> None:
    """The masked/trained boundaries of a tool chat sit where the official generation prompts end."""
    turns = ours(name, TOOL_MULTI, tokenizer, SYSTEM, json.dumps(TOOLS))
    for k in range(len(turns)):
        prompt_text = joined(turns[:k]) + turns[k][0]
        assert prompt_text == official_tool_chat(name, TOOL_MULTI[: 2 * k + 1], tokenizer, SYSTEM,
                                                 MISTRAL_IDS["multi"], add_generation_prompt=True)


def test_mistral_tool_prompt_with_system_equals_the_official_generation_prompt(tokenizer: Any) -> None:
    """Tools and the system prompt both go with the last user message, as the official template renders the
    prompt whose last message is that user message (it has no generation prompt of its own)."""
    turns = ours("mistral", TOOL_MULTI, tokenizer, SYSTEM, json.dumps(TOOLS))
    assert joined(turns[:1]) + turns[1][0] == official_tool_chat("mistral", TOOL_MULTI[:3], tokenizer, SYSTEM, [])
    assert turns[1][0] == ('[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "add", "description": '
                           '"Add two numbers", "parameters": {"type": "object", "properties": {"a": {"type": '
                           '"number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}][/AVAILABLE_TOOLS]'
                           f"[INST] {SYSTEM}\n\n{Q2}[/INST]")


def test_mistral_parallel_calls_take_one_result_per_call(tokenizer: Any) -> None:
    calls = [CALL, {"name": "add", "arguments": {"a": 1, "b": 2}}]
    chat = [{"role": "user", "content": Q2}, {"role": "function", "content": json.dumps(calls)},
            {"role": "observation", "content": json.dumps(["6", "3"])}, {"role": "assistant", "content": A2}]
    expected = official("mistral", openai_messages(chat, ["000000000", "000000001"]), tokenizer,
                        tools=WRAPPED_TOOLS)
    assert joined(ours("mistral", chat, tokenizer, tools=json.dumps(TOOLS))) == expected
    with pytest.raises(DataError, match="needs its results as a JSON list of 2 items"):
        ours("mistral", chat[:2] + [{"role": "observation", "content": "6"}] + chat[3:], tokenizer)


@pytest.mark.parametrize("name", ["qwen", "llama3", "mistral", "glm4"])
def test_placeholders_in_tool_data_stay_literal(tokenizer: Any, name: str) -> None:
    chat = TOOL_CHAT[:2] + [{"role": "observation", "content": "{eos} {content}"}] + TOOL_CHAT[3:]
    assert "{eos} {content}" in ours(name, chat, tokenizer, tools=json.dumps(TOOLS))[1][0]


@pytest.mark.parametrize("messages", [SINGLE, MULTI])
def test_mistral_plain_chat_equals_the_official_template(tokenizer: Any, messages: list[dict[str, str]]) -> None:
    assert joined(ours("mistral", messages, tokenizer)) == official("mistral", messages, tokenizer)


@pytest.mark.parametrize(("name", "family"), [("llama3", "Llama 3.1"), ("glm4", "GLM-4")])
def test_parallel_calls_are_refused_where_the_official_template_has_one_call_per_turn(
        tokenizer: Any, name: str, family: str) -> None:
    chat = [TOOL_CHAT[0], {"role": "function", "content": json.dumps([CALL, CALL])}] + TOOL_CHAT[2:]
    with pytest.raises(DataError, match=f"official {family} chat template writes one tool call per assistant"):
        ours(name, chat, tokenizer, tools=json.dumps(TOOLS))


@pytest.mark.parametrize(("name", "reason"), [
    ("llama2", "its official chat template defines no tool calling"),
    ("deepseek3", "writes no tool definitions"), ("gpt_oss", "TypeScript namespace"),
    ("llama4", "Llama 4's tool layout is not written by this named template; template: auto"),
    ("gemma4", "Gemma 4's tool layout is not written by this named template; template: auto"),
    ("qwen2_vl", "set tool_format: qwen")])
def test_templates_without_a_tool_format_refuse_tool_data_with_the_reason(tokenizer: Any, name: str,
                                                                          reason: str) -> None:
    with pytest.raises(DataError, match=f"template '{name}' has no tool-call format \\(.*{reason}"):
        ours(name, TOOL_CHAT, tokenizer, tools=json.dumps(TOOLS))


REASONED = [{"role": "user", "content": Q1}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            {"role": "user", "content": Q2}, {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"}]


def test_qwen3_keeps_only_the_last_reasoning_as_the_official_template(tokenizer: Any) -> None:
    turns = ours("qwen3", REASONED, tokenizer)
    assert joined(turns) == official("qwen3", REASONED, tokenizer)
    assert turns[0][1] == "4<|im_end|>\n"
    assert turns[1][1] == "<think>\nadd again\n</think>\n\n6<|im_end|>\n"


def test_qwen3_enable_thinking_false_masks_an_empty_think_block(tokenizer: Any) -> None:
    turns = ours("qwen3", REASONED, tokenizer, enable_thinking=False)
    assert turns[1] == (f"<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
                        "6<|im_end|>\n")
    # the prompt piece is exactly the official no-think generation prompt
    assert joined(turns[:1]) + turns[1][0] == official("qwen3", REASONED[:3], tokenizer, add_generation_prompt=True,
                                                      enable_thinking=False)


@pytest.mark.parametrize("name", ["qwen3_5", "glm4_moe"])
def test_reasoning_is_kept_only_after_the_last_query_as_the_official_template(tokenizer: Any, name: str) -> None:
    turns = ours(name, REASONED, tokenizer)
    assert joined(turns) == deliberate(name, official(name, REASONED, tokenizer))
    if name == "qwen3_5":  # the generation prompt opens the block: the opener is masked
        assert turns[0][1] == "4<|im_end|>\n"
        assert turns[1] == (f"<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n<think>\n",
                            "add again\n</think>\n\n6<|im_end|>\n")
    else:  # every GLM answer opens with a block, empty before the last query; <|user|> ends (is trained with) it
        assert turns[0][1] == "\n<think></think>\n4<|user|>"
        assert turns[1] == (f"\n{Q2}<|assistant|>", f"\n<think>add again</think>\n6{EOS}")


@pytest.mark.parametrize(("name", "options"), [("qwen3_5", {"enable_thinking": False}), ("qwen3_5_nothink", {}),
                                               ("glm4_moe", {"enable_thinking": False}),
                                               ("gemma4", {"enable_thinking": False})])
def test_thinking_off_masks_the_empty_block_of_the_official_no_think_prompt(tokenizer: Any, name: str,
                                                                            options: dict[str, bool]) -> None:
    fixture = name.removesuffix("_nothink")
    turns = ours(name, REASONED, tokenizer, **options)
    assert joined(turns[:1]) + turns[1][0] == official(fixture, REASONED[:3], tokenizer, add_generation_prompt=True,
                                                      enable_thinking=False)
    # Gemma 4's reasoning markers are its thought channel: "<think>" is answer text to it
    assert turns[1][1] == {"glm4_moe": f"\n6{EOS}", "gemma4": f"{REASONED[3]['content']}<turn|>\n"}.get(
        name, "6<|im_end|>\n")
    if name != "gemma4":  # the official full rendering of Gemma 4 omits the empty thought channel the prompt ends with
        # (reasoning in the data is dropped with thinking off, so the whole text is compared on a chat without it)
        assert joined(ours(name, MULTI, tokenizer, **options)) == deliberate(
            fixture, official(fixture, MULTI, tokenizer, enable_thinking=False))


def test_gemma4_keeps_the_last_thought_channel_and_opens_the_system_turn_with_think(tokenizer: Any) -> None:
    reasoned = [{"role": "user", "content": Q1}, {"role": "assistant", "content": "<|channel>thought\nadd<channel|>4"}]
    turns = ours("gemma4", reasoned, tokenizer)
    assert turns == [(f"{BOS}<|turn>system\n<|think|><turn|>\n<|turn>user\n{Q1}<turn|>\n<|turn>model\n",
                      "<|channel>thought\nadd<channel|>4<turn|>\n")]
    # the official template drops the thought channel from every answer; the text around it is the same
    assert joined(turns).replace("<|channel>thought\nadd<channel|>", "") == official("gemma4", reasoned, tokenizer)


def test_qwen3_nothink_has_no_think_block(tokenizer: Any) -> None:
    assert ours("qwen3_nothink", SINGLE, tokenizer) == [
        (f"<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n", f"{A1}<|im_end|>\n")]


# Hand-checked (prompt, response) pairs for a system prompt + two turns: LLaMA-Factory's own formats (default,
# empty, alpaca), FastChat's vicuna_v1.1, chatml, and Mistral-7B-Instruct-v0.3 (no verbatim source found here).
HAND = {
    "default": [f"System: {SYSTEM}{EOS}\nHuman: {Q1}{EOS}\nAssistant:", f"{A1}{EOS}\n",
                f"Human: {Q2}{EOS}\nAssistant:", f"{A2}{EOS}\n"],
    "empty": [f"{SYSTEM}{Q1}", A1, Q2, A2],
    "alpaca": [f"{SYSTEM}\n\n### Instruction:\n{Q1}\n\n### Response:\n", f"{A1}{EOS}\n\n",
               f"### Instruction:\n{Q2}\n\n### Response:\n", f"{A2}{EOS}\n\n"],
    "vicuna": [f"{BOS}{SYSTEM} USER: {Q1} ASSISTANT:", f" {A1}{EOS}", f"USER: {Q2} ASSISTANT:", f" {A2}{EOS}"],
    "chatml": [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n",
               f"{A1}<|im_end|>\n", f"<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n", f"{A2}<|im_end|>\n"],
    "mistral": [f"{BOS}[INST] {Q1}[/INST]", f" {A1}{EOS}", f"[INST] {SYSTEM}\n\n{Q2}[/INST]", f" {A2}{EOS}"],
    # Qwen3-VL-Thinking / -Instruct (no official copy found): Qwen3's layout; the thinking one's generation prompt
    # opens the block, so the final answer's "<think>\n" is masked.
    "qwen3_vl": [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n",
                 f"{A1}<|im_end|>\n", f"<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n<think>\n",
                 f"\n</think>\n\n{A2}<|im_end|>\n"],
    "qwen3_vl_nothink": [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n"
                         "<|im_start|>assistant\n", f"{A1}<|im_end|>\n",
                         f"<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n", f"{A2}<|im_end|>\n"],
}


def test_every_named_template_is_checked() -> None:
    checked = set(HAND) | {name for name, _, _ in OFFICIAL} | {"qwen3_nothink", "qwen3_5_nothink", "auto"}
    assert checked == set(TEMPLATES)


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_checked_text(tokenizer: Any, name: str) -> None:
    turns = ours(name, MULTI, tokenizer, SYSTEM)
    assert [piece for turn in turns for piece in turn] == HAND[name]


@pytest.mark.parametrize(("name", "fixture"), [("llama3", "llama3"), ("llama4", "llama4"), ("cohere", "cohere"),
                                             ("qwen3_5", "qwen3_5"), ("gemma4", "gemma4"), ("glm4_moe", "glm4_moe"),
                                             ("deepseek3", "deepseek3")])
def test_system_prompt_is_trimmed_where_the_official_template_trims_it(tokenizer: Any, name: str, fixture: str) -> None:
    expected = official(fixture, SINGLE, tokenizer, f" {SYSTEM}\n")
    assert joined(ours(name, SINGLE, tokenizer, f" {SYSTEM}\n")) == deliberate(name, expected)


def test_default_system_replaces_the_templates_default(tokenizer: Any) -> None:
    assert ours("qwen", SINGLE, tokenizer, default_system="Be kind.")[0][0].startswith(
        "<|im_start|>system\nBe kind.<|im_end|>\n")
    assert ours("qwen", SINGLE, tokenizer, SYSTEM, default_system="Be kind.")[0][0].startswith(
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")


def test_tools_on_a_template_without_a_tool_format_is_refused(tokenizer: Any) -> None:
    with pytest.raises(DataError, match="template 'llama2' has no tool-call format"):
        ours("llama2", TOOL_CHAT, tokenizer)
    turns = ours("chatml", TOOL_CHAT, tokenizer, tools=json.dumps(TOOLS), tool_format="qwen")
    assert "<tool_response>\n6\n</tool_response>" in turns[1][0]


def test_unknown_template_suggests_the_closest_and_auto() -> None:
    with pytest.raises(DataError, match=r"unknown template 'llama_3' \(did you mean 'llama3'\?\); or use 'auto'"):
        get_template("llama_3")
    with pytest.raises(DataError, match="tool_format 'gemma4' is not supported"):
        get_template("gemma3", tool_format="gemma4")


def encode_one(tokenizer: Any, name: str, messages: list[dict[str, str]], tools: str = "",
               **options: Any) -> tuple[list[int], list[int]]:
    batch = {"_system": [""], "_messages": [messages], "tools": [tools]}
    out = encode_sft_batch(batch, tokenizer, get_template(name, **options), SftOptions(cutoff_len=4096))
    return out["input_ids"][0], out["labels"][0]




@pytest.mark.parametrize("name", ["qwen3", "llama3", "vicuna", "phi"])
def test_ids_and_label_mask(tokenizer: Any, name: str) -> None:
    pieces = [piece for turn in ours(name, MULTI, tokenizer) for piece in turn]
    assert encode_one(tokenizer, name, MULTI) == expected_ids_and_labels(tokenizer, pieces)


def test_tool_chat_ids_mask_tool_results_and_train_calls(tokenizer: Any) -> None:
    ids, labels = encode_one(tokenizer, "qwen3", TOOL_CHAT, json.dumps(TOOLS))
    trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert trained == ('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 3}}\n</tool_call><|im_end|>\n'
                       f"<think>\n\n</think>\n\n{A2}<|im_end|>\n")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert labels.count(im_end) == 2  # both answers' end-of-turn tokens are trained


def test_llama3_tool_chat_ids_mask_prompts_and_results_and_train_calls_and_answers(tokenizer: Any) -> None:
    ids, labels = encode_one(tokenizer, "llama3", TOOL_MULTI, json.dumps(TOOLS))
    pieces = [piece for turn in ours("llama3", TOOL_MULTI, tokenizer, tools=json.dumps(TOOLS)) for piece in turn]
    assert (ids, labels) == expected_ids_and_labels(tokenizer, pieces)
    trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert trained == (f'{A1}<|eot_id|>{{"name": "add", "parameters": {{"a": 3, "b": 3}}}}<|eot_id|>'
                       f"{A2}<|eot_id|>")
    masked = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label == IGNORE_INDEX])
    assert "Environment: ipython" in masked and '"6"<|eot_id|>' in masked and "Given the following functions" in masked


def test_enable_thinking_false_masks_the_empty_block_in_ids(tokenizer: Any) -> None:
    ids, labels = encode_one(tokenizer, "qwen3", SINGLE, enable_thinking=False)
    trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert trained == f"{A1}<|im_end|>\n"
    assert "<think>" in tokenizer.decode(ids)


def test_fullwidth_special_tokens_are_reported_when_the_tokenizer_lacks_them(tokenizer: Any) -> None:
    assert missing_special_tokens(get_template("deepseek3"), tokenizer) == [
        "<｜Assistant｜>", "<｜User｜>", "<｜end▁of▁sentence｜>"]


PARALLEL_CALLS = [CALL, {"name": "add", "arguments": {"a": "x y", "b": {"c": [1, "é"]}}}]
PARALLEL_CHAT = [{"role": "user", "content": Q2}, {"role": "function", "content": json.dumps(PARALLEL_CALLS)},
                 {"role": "observation", "content": json.dumps(["6", "7"])}, {"role": "assistant", "content": A2}]


@pytest.mark.parametrize("chat", ["single", "multi", "parallel"])
@pytest.mark.parametrize("system", ["", SYSTEM])
def test_glm4_moe_tool_chats_equal_the_official_template(tokenizer: Any, chat: str, system: str) -> None:
    """GLM-4.5/4.6's XML layout: tools as JSON lines, <arg_key>/<arg_value> pairs (strings raw, the rest JSON),
    parallel calls answered by one <|observation|> with a <tool_response> per call."""
    messages = {"single": TOOL_CHAT, "multi": TOOL_MULTI, "parallel": PARALLEL_CHAT}[chat]
    tools = WRAPPED_TOOLS * (2 if chat == "parallel" else 1)
    expected = official("glm4_moe", openai_messages(messages), tokenizer, system, tools=tools)
    assert joined(ours("glm4_moe", messages, tokenizer, system, json.dumps(tools))) == deliberate("glm4_moe", expected)


def test_glm4_moe_tool_prompt_pieces_are_the_official_generation_prompts(tokenizer: Any) -> None:
    turns = ours("glm4_moe", TOOL_MULTI, tokenizer, SYSTEM, json.dumps(TOOLS))
    for k in range(len(turns)):
        prompt_text = joined(turns[:k]) + turns[k][0]
        generation = official("glm4_moe", openai_messages(TOOL_MULTI[: 2 * k + 1]), tokenizer, SYSTEM,
                              tools=WRAPPED_TOOLS, add_generation_prompt=True)
        assert prompt_text == generation


def test_glm4_moe_parallel_results_need_one_item_per_call(tokenizer: Any) -> None:
    chat = [*PARALLEL_CHAT[:2], {"role": "observation", "content": "6"}, PARALLEL_CHAT[3]]
    with pytest.raises(DataError, match="GLM-4.5 tool-call turn with 2 calls needs its results as a JSON list"):
        ours("glm4_moe", chat, tokenizer, tools=json.dumps(TOOLS))
