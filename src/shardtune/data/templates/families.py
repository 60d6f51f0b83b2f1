"""The named templates, under LLaMA-Factory's names, each following its family's official chat_template.

Where LLaMA-Factory's own template renders different text, the official one is followed and the
difference is noted on the entry (docs/from-llamafactory.md, "Templates", lists them all).
"""

from __future__ import annotations

from typing import TypedDict

from shardtune.data.templates.auto import TokenizerChatTemplate
from shardtune.data.templates.base import Template
from shardtune.data.templates.thinking import (
    DEEPSEEK_R1_THINKING,
    GEMMA4_THINKING,
    GLM4_MOE_THINKING,
    QWEN3_5_THINKING,
    QWEN3_THINKING,
    QWEN3_VL_THINKING,
)
from shardtune.data.templates.tools import (
    GLM4_5_TOOLS,
    GLM4_TOOLS,
    LLAMA3_TOOLS,
    MISTRAL_TOOLS,
    QWEN3_5_TOOLS,
    QWEN_TOOLS,
)


class _TurnFormats(TypedDict):
    """The turn layout several templates share, spread into ``Template(...)``."""

    system_format: str
    user_format: str
    assistant_format: str
    stop_word: str


class _GemmaFormats(_TurnFormats):
    """Gemma's turns plus its bos prefix and system prompt inside the first user turn."""

    prefix: str
    system_placement: str


_CHATML: _TurnFormats = {
    "system_format": "<|im_start|>system\n{content}<|im_end|>\n",
    "user_format": "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
    "assistant_format": "{content}<|im_end|>\n",
    "stop_word": "<|im_end|>",
}
_YI_TURNS: _TurnFormats = {**_CHATML, "system_format": "{content}"}  # chatml turns, bare system text
# GLM-4 and GLM-4.5/4.6: no end-of-turn token after answers (the next "<|user|>" stops generation).
_GLM4_TURNS: _TurnFormats = {"system_format": "<|system|>\n{content}",
                              "user_format": "<|user|>\n{content}<|assistant|>", "assistant_format": "\n{content}",
                              "stop_word": "<|user|>"}
# The role tokens GLM-4 stops on (its generation config's eos ids besides <|endoftext|>): trained after each answer.
_GLM4_CLOSING = ("<|user|>", "<|observation|>")
def _tools_through_auto(family: str) -> str:
    return (f"{family}'s tool layout is not written by this named template; template: auto renders it with the "
            "tokenizer's own chat template")


GPT_OSS_DATE = "2025-08-05"  # gpt-oss's release date, pinned into its system block (see "gpt_oss")
_LLAMA3_HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"
_LLAMA4_HEADER = "<|header_start|>{role}<|header_end|>\n\n"
_GEMMA: _GemmaFormats = {
    "prefix": "{bos}",
    "system_format": "{content}\n\n",
    "system_placement": "first_user",
    "user_format": "<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n",
    "assistant_format": "{content}<end_of_turn>\n",
    "stop_word": "<end_of_turn>",
}


def _llama3_turns(header: str, end: str) -> _TurnFormats:
    return {
        "system_format": header.format(role="system") + "{content}" + end,
        "user_format": header.format(role="user") + "{content}" + end + header.format(role="assistant"),
        "assistant_format": "{content}" + end,
        "stop_word": end,
    }


TEMPLATES: dict[str, Template] = {
    # LLaMA-Factory's own formats (no model ships them), rendered as LLaMA-Factory does.
    "default": Template(
        name="default",
        system_format="System: {content}{eos}\n",
        user_format="Human: {content}{eos}\nAssistant:",
        assistant_format="{content}{eos}\n",
    ),
    "empty": Template(name="empty", user_format="{content}", assistant_format="{content}"),
    # Stanford Alpaca's prompt. LLaMA-Factory glues a custom system prompt to "### Instruction"
    # without the blank line; the default system text is identical.
    "alpaca": Template(
        name="alpaca",
        system_format="{content}\n\n",
        default_system="Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.",
        user_format="### Instruction:\n{content}\n\n### Response:\n",
        assistant_format="{content}{eos}\n\n",
    ),
    # FastChat's vicuna_v1.1: "SYSTEM USER: q ASSISTANT: a</s>USER: ...". LLaMA-Factory drops the space
    # after the system prompt and after "ASSISTANT:".
    "vicuna": Template(
        name="vicuna",
        prefix="{bos}",
        system_format="{content} ",
        default_system="A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions.",
        user_format="USER: {content} ASSISTANT:",
        assistant_format=" {content}{eos}",
    ),
    "chatml": Template(name="chatml", **_CHATML),
    # Llama-2-chat: system inside the first [INST], contents stripped, " answer </s>" with spaces.
    # LLaMA-Factory writes "[/INST]answer</s>" (no spaces).
    "llama2": Template(
        name="llama2",
        system_format="<<SYS>>\n{content}\n<</SYS>>\n\n",
        system_placement="first_user",
        user_format="{bos}[INST] {content} [/INST]",
        assistant_format=" {content} {eos}",
        strip_content=True,
    ),
    # Meta-Llama-3-Instruct: every content is trimmed, the system prompt too (LLaMA-Factory does not trim).
    # Llama 3.1+ official templates also add a "Cutting Knowledge Date" system block; LLaMA-Factory and this one do
    # not, except in a conversation with tool definitions, which is written in the Llama 3.1 tool layout (tools.py).
    # Pre-training documents end with <|end_of_text|> (the Instruct tokenizer's eos is the chat stop <|eot_id|>).
    "llama3": Template(name="llama3", prefix="{bos}", strip_content=True, strip_system=True, tool_style=LLAMA3_TOOLS,
                       document_end="<|end_of_text|>", **_llama3_turns(_LLAMA3_HEADER, "<|eot_id|>")),
    # Llama 4 trims the system prompt only (LLaMA-Factory does not trim).
    "llama4": Template(name="llama4", prefix="{bos}", strip_system=True, **_llama3_turns(_LLAMA4_HEADER, "<|eot|>"),
                       no_tools_reason=_tools_through_auto("Llama 4")),
    # Mistral-7B-Instruct-v0.3: the system prompt goes into the LAST user message (LLaMA-Factory: first).
    "mistral": Template(
        name="mistral",
        prefix="{bos}",
        system_format="{content}\n\n",
        system_placement="last_user",
        user_format="[INST] {content}[/INST]",
        assistant_format=" {content}{eos}",
        tool_style=MISTRAL_TOOLS,
    ),
    # Qwen2.5-Instruct.
    "qwen": Template(name="qwen", default_system="You are Qwen, created by Alibaba Cloud. You are a helpful "
                     "assistant.", tool_style=QWEN_TOOLS, **_CHATML),
    # Qwen3 (hybrid thinking): reasoning kept only after the last user query, the final answer always
    # has a think block. LLaMA-Factory keeps every turn's reasoning and adds empty blocks to all turns.
    "qwen3": Template(name="qwen3", thinking=QWEN3_THINKING, tool_style=QWEN_TOOLS, **_CHATML),
    # Qwen3-Instruct-2507 (no thinking).
    "qwen3_nothink": Template(name="qwen3_nothink", tool_style=QWEN_TOOLS, **_CHATML),
    # Qwen3.5 (Qwen/Qwen3.5-4B): every content trimmed; each answer after the last query has a think block and
    # the generation prompt opens it ("<think>\n", masked). Tools in Qwen3.5's XML layout (tools.py).
    # LLaMA-Factory keeps every turn's reasoning, adds empty blocks to all turns and trains the opener.
    "qwen3_5": Template(name="qwen3_5", thinking=QWEN3_5_THINKING, strip_content=True, strip_system=True,
                        tool_style=QWEN3_5_TOOLS, **_CHATML),
    # The same official template with enable_thinking=false, which is fixed here: the empty block after the last
    # query is masked with the prompt (LLaMA-Factory's qwen3_5_nothink writes no block at all).
    "qwen3_5_nothink": Template(name="qwen3_5_nothink", thinking=QWEN3_5_THINKING, enable_thinking=False,
                                strip_content=True, strip_system=True, tool_style=QWEN3_5_TOOLS, **_CHATML),
    # Qwen2-VL / Qwen2.5-VL-Instruct, text turns (images are expanded by the data layer): chatml with Qwen's
    # default system prompt. The official template has no tool layout (LLaMA-Factory: qwen's).
    "qwen2_vl": Template(name="qwen2_vl", default_system="You are a helpful assistant.",
                         no_tools_reason="Qwen2-VL's official template has none; set tool_format: qwen", **_CHATML),
    # Qwen3-VL-Thinking, text turns: Qwen3's reasoning rule, the generation prompt opens the think block
    # (defined from LLaMA-Factory and Qwen3-Thinking-2507's layout: no official copy was found).
    "qwen3_vl": Template(name="qwen3_vl", thinking=QWEN3_VL_THINKING, tool_style=QWEN_TOOLS, **_CHATML),
    # Qwen3-VL-Instruct, text turns: as qwen3_nothink.
    "qwen3_vl_nothink": Template(name="qwen3_vl_nothink", tool_style=QWEN_TOOLS, **_CHATML),
    # Gemma 1/2 reject a system role; Gemma 3 prepends it to the first user turn, used for all three.
    # Contents are trimmed (LLaMA-Factory does not trim).
    "gemma": Template(name="gemma", strip_content=True, **_GEMMA),
    "gemma3": Template(name="gemma3", strip_content=True, **_GEMMA),
    # Gemma 4: its own turn markers and a system turn. Thinking on (shardtune's default; the model's default is
    # off) opens the system turn with "<|think|>"; off, the answer after the last query follows the empty thought
    # channel the official generation prompt ends with (masked; the official full rendering omits it). Reasoning
    # in the data is written "<|channel>thought\n...<channel|>" (LLaMA-Factory's thought words); the official
    # template drops it everywhere, shardtune keeps it after the last query (as the model writes it).
    # LLaMA-Factory always writes "<|think|>" and "You are a helpful assistant." as the system prompt.
    "gemma4": Template(
        name="gemma4",
        prefix="{bos}",
        system_format="<|turn>system\n{content}<turn|>\n",
        user_format="<|turn>user\n{content}<turn|>\n<|turn>model\n",
        assistant_format="{content}<turn|>\n",
        stop_word="<turn|>",
        strip_content=True,
        strip_system=True,
        thinking=GEMMA4_THINKING,
        no_tools_reason=_tools_through_auto("Gemma 4"),
    ),
    # Phi-3-mini-instruct: the rendered chat ends with eos after the last "<|end|>\n" (LLaMA-Factory: no eos).
    "phi": Template(
        name="phi",
        system_format="<|system|>\n{content}<|end|>\n",
        user_format="<|user|>\n{content}<|end|>\n<|assistant|>\n",
        assistant_format="{content}<|end|>\n",
        final_suffix="{eos}",
        stop_word="<|end|>",
    ),
    "phi4": Template(
        name="phi4",
        system_format="<|im_start|>system<|im_sep|>{content}<|im_end|>",
        user_format="<|im_start|>user<|im_sep|>{content}<|im_end|><|im_start|>assistant<|im_sep|>",
        assistant_format="{content}<|im_end|>",
        stop_word="<|im_end|>",
    ),
    # deepseek-llm-chat: "User: q\n\nAssistant: a<eos>" (LLaMA-Factory drops the space after "Assistant:").
    "deepseek": Template(
        name="deepseek",
        prefix="{bos}",
        system_format="{content}\n\n",
        user_format="User: {content}\n\nAssistant:",
        assistant_format=" {content}{eos}",
    ),
    # DeepSeek-V3: the system text follows BOS directly; answers end with the literal
    # "<｜end▁of▁sentence｜>" written in the official template (not the tokenizer's eos).
    "deepseek3": Template(
        name="deepseek3",
        prefix="{bos}",
        user_format="<｜User｜>{content}<｜Assistant｜>",
        assistant_format="{content}<｜end▁of▁sentence｜>",
        stop_word="<｜end▁of▁sentence｜>",
        no_tools_reason="DeepSeek-V3's official template writes no tool definitions and leaves a single call "
        "without its closing <｜tool▁calls▁end｜>",
    ),
    # DeepSeek-R1 (and its Qwen/Llama distills): DeepSeek-V3's turns; the generation prompt opens the think block
    # ("<think>\n", masked) and the answer after the last question carries it, its reasoning kept; the official
    # template drops the reasoning of every answer it shows. LLaMA-Factory trains the "<think>\n" opener.
    "deepseekr1": Template(
        name="deepseekr1",
        prefix="{bos}",
        user_format="<｜User｜>{content}<｜Assistant｜>",
        assistant_format="{content}<｜end▁of▁sentence｜>",
        stop_word="<｜end▁of▁sentence｜>",
        thinking=DEEPSEEK_R1_THINKING,
        no_tools_reason="DeepSeek-R1's tool-call layout is not written by this named template",
    ),
    # GLM-4-chat: no end-of-turn token after answers (the next "<|user|>" stops generation); the final
    # answer gets eos so that training teaches stopping, as LLaMA-Factory's efficient_eos does.
    # The next turn's <|user|> / <|observation|> is trained with the answer before it, as the token the model stops
    # on; LLaMA-Factory (efficient_eos) trains eos at that position instead, which the input never shows there.
    "glm4": Template(name="glm4", prefix="[gMASK]<sop>", final_suffix="{eos}", tool_style=GLM4_TOOLS,
                     closing_roles=_GLM4_CLOSING, **_GLM4_TURNS),
    # GLM-4.5/4.6 (zai-org/GLM-4.6's template): GLM-4's markers, every answer opens with a think block (empty
    # before the last query), answers trimmed; thinking off masks the empty block and appends "/nothink" to each
    # user message, as the official template does. eos after the final answer as glm4 (LLaMA-Factory: same).
    "glm4_moe": Template(name="glm4_moe", prefix="[gMASK]<sop>", final_suffix="{eos}", thinking=GLM4_MOE_THINKING,
                         tool_style=GLM4_5_TOOLS, closing_roles=_GLM4_CLOSING, **_GLM4_TURNS),
    # Yi-1.5-chat: the system text is written as is, before the first turn (no chatml block).
    "yi": Template(name="yi", **_YI_TURNS),
    # Command-R: contents stripped (LLaMA-Factory does not strip).
    "cohere": Template(
        name="cohere",
        prefix="{bos}",
        system_format="<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{content}<|END_OF_TURN_TOKEN|>",
        user_format="<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{content}<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        assistant_format="{content}<|END_OF_TURN_TOKEN|>",
        stop_word="<|END_OF_TURN_TOKEN|>",
        strip_content=True,
    ),
    # InternLM2-chat jinja: BOS + chatml, eos after the last answer, no default system (LLaMA-Factory
    # adds InternLM's meta-instruction, which only the model's remote-code chat() uses).
    "intern2": Template(name="intern2", prefix="{bos}", final_suffix="{eos}", **_CHATML),
    # gpt-oss (harmony), as openai/gpt-oss-20b's chat_template.jinja: a fixed system block, the
    # system prompt as the developer's "# Instructions", final-channel answers, "<|return|>" after the
    # last one. The official block carries strftime_now()'s date; a training template cannot follow
    # the clock, so the date is pinned to GPT_OSS_DATE (the tests render the official one with it).
    # Reasoning effort is the official default, medium.
    "gpt_oss": Template(
        name="gpt_oss",
        prefix="<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {GPT_OSS_DATE}\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>",
        system_format="<|start|>developer<|message|># Instructions\n\n{content}\n\n<|end|>",
        user_format="<|start|>user<|message|>{content}<|end|><|start|>assistant",
        assistant_format="<|channel|>final<|message|>{content}<|end|>",
        last_assistant_format="<|channel|>final<|message|>{content}<|return|>",
        stop_word="<|return|>",
        no_tools_reason="gpt-oss's tool layout (a TypeScript namespace in the developer message, commentary-"
        "channel calls) is not implemented in shardtune",
    ),
    # HuggingFaceH4/zephyr-7b-beta: "<|user|>\n...</s>\n<|assistant|>\n"; no default system prompt, as the official
    # template (LLaMA-Factory: "You are Zephyr, a helpful assistant.", and no "\n" after each eos).
    "zephyr": Template(
        name="zephyr",
        system_format="<|system|>\n{content}{eos}\n",
        user_format="<|user|>\n{content}{eos}\n<|assistant|>\n",
        assistant_format="{content}{eos}\n",
    ),
    "auto": TokenizerChatTemplate(),
}
