"""Tool definitions, tool calls and tool results as the families' official chat templates write them.

The dataset's ``tools`` column is a JSON string: a list of function definitions
(``{"name", "description", "parameters"}``, or OpenAI's ``{"type": "function", "function": ...}``).
A tool-call answer is the JSON ``{"name", "arguments"}`` or a list of them (LLaMA-Factory's shape).
JSON is written as jinja's ``tojson`` in transformers writes it: ``json.dumps`` with non-ASCII kept.

Each ``ToolStyle`` names LLaMA-Factory's ``tool_format`` and writes its family's own turn markers, so
it belongs with a template of the same layout (``qwen`` and ``qwen3_5`` with chatml templates, ``llama3`` with llama3,
``mistral`` with mistral, ``glm4`` with glm4, ``glm4_moe`` with glm4_moe).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shardtune.errors import DataError

ToolList = list[dict[str, Any]]
Call = dict[str, Any]

QWEN_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)
QWEN3_5_TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN3_5_TOOLS_OUTRO = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
# The official Llama 3.1 template's default date_string: a training text cannot follow the clock.
LLAMA3_DATE = "26 Jul 2024"
LLAMA3_HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"
LLAMA3_CALL_RULE = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                    'value}.Do not use variables.\n\n')
GLM4_TOOLS_INTRO = ("<|system|>\n你是一个名为 ChatGLM 的人工智能助手。你是基于智谱AI训练的语言模型 GLM-4 模型开发的，"
                    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具")
GLM4_CALL_RULE = "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
GLM4_5_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
GLM4_5_TOOLS_OUTRO = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
)


def to_json(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def parse_tools(text: str) -> ToolList:
    """The function definitions in a ``tools`` string ("" or "[]" means none), in OpenAI's wrapped shape."""
    if not text or not text.strip():
        return []
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"the 'tools' column must be a JSON list of function definitions: {err}") from None
    tools = tools if isinstance(tools, list) else [tools]
    if not all(isinstance(tool, dict) for tool in tools):
        raise DataError("the 'tools' column must be a JSON list of objects (function definitions)")
    return [tool if tool.get("type") == "function" else {"type": "function", "function": tool} for tool in tools]


def parse_tool_calls(text: str) -> list[Call]:
    """The calls in a tool-call message: ``{"name", "arguments"}`` objects (arguments may be a JSON string)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"a tool-call message must be JSON {{\"name\", \"arguments\"}} or a list of them: {err}"
                        ) from None
    calls = calls if isinstance(calls, list) else [calls]
    for call in calls:
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            raise DataError(f"a tool call must be an object with 'name' and 'arguments', got {to_json(call)}")
    return calls


def arguments_object(call: Call) -> Any:
    """A call's arguments as an object: the official templates serialise them with ``tojson`` themselves."""
    arguments = call["arguments"]
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise DataError(f"tool call '{call['name']}': arguments must be a JSON object, got {arguments!r}") from None


def single_call(calls: list[Call], family: str) -> Call:
    if len(calls) != 1:
        raise DataError(f"the official {family} chat template writes one tool call per assistant turn, but a turn "
                        f"has {len(calls)}; split parallel calls into separate call/result turns")
    return calls[0]


def named_arguments(call: Call, family: str, written_as: str) -> dict[str, Any]:
    """A call's arguments as the JSON object a family that writes one block per argument needs."""
    arguments = arguments_object(call)
    if not isinstance(arguments, dict):
        raise DataError(f"tool call '{call['name']}': {family} writes arguments as {written_as}, so they must be a "
                        f"JSON object, got {to_json(arguments)}")
    return arguments


def results_per_call(content: str, call_count: int, family: str = "") -> list[str]:
    """A tool-result message as one text per call it answers: several calls take a JSON list, one item per call
    (items that are not strings written as JSON)."""
    if call_count <= 1:
        return [content]
    results = json.loads(content) if content.lstrip().startswith("[") else []
    if len(results) != call_count:
        turn = f"a {family} tool-call turn" if family else "a tool-call turn"
        raise DataError(f"{turn} with {call_count} calls needs its results as a JSON list of {call_count} items (one "
                        f"per call), got {content!r}")
    return [text if isinstance(text, str) else to_json(text) for text in results]


@dataclass(frozen=True)
class ToolStyle:
    """How one family writes tool definitions, the assistant's tool calls and the tool results.

    ``call_format``, when set, replaces the template's answer format for a tool-call turn (Mistral's
    calls have no leading space, GLM-4's have no newline before the function name).
    """

    name: str
    call_format: str | None = None

    def system_block(self, system: str, tools: ToolList) -> str | None:
        """The system turn carrying the tool list, or None where the tools go into a user turn."""
        return None

    def user_content(self, content: str, tools: ToolList, is_first: bool, is_last: bool) -> str:
        """A user message's text, with the tool list where the family writes it inside the message."""
        return content

    def before_user(self, tools: ToolList, is_first: bool, is_last: bool) -> str:
        """Text before a user turn (Mistral writes the tool list just before the last one)."""
        return ""

    def calls(self, calls: list[Call], turn: int) -> str:
        """Tool calls as answer text (``turn``: the index of the ask/answer pair)."""
        raise NotImplementedError

    def result(self, content: str, turn: int, call_count: int) -> str:
        """A tool result as prompt text, ending with the assistant header (``call_count``: calls it answers)."""
        raise NotImplementedError


@dataclass(frozen=True)
class QwenTools(ToolStyle):
    """Qwen2.5 and Qwen3 (Hermes-style): tools in the system turn, results as a user turn in <tool_response>."""

    def system_block(self, system: str, tools: ToolList) -> str:
        listed = "".join("\n" + to_json(tool) for tool in tools)
        lead = system + "\n\n" if system else ""
        return f"<|im_start|>system\n{lead}{QWEN_TOOLS_INTRO}{listed}{QWEN_TOOLS_OUTRO}<|im_end|>\n"

    def calls(self, calls: list[Call], turn: int) -> str:
        blocks = []
        for call in calls:
            arguments = call["arguments"]
            written = arguments if isinstance(arguments, str) else to_json(arguments)
            blocks.append(f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {written}}}\n</tool_call>')
        return "\n".join(blocks)

    def result(self, content: str, turn: int, call_count: int) -> str:
        return f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Qwen35Tools(QwenTools):
    """Qwen3.5 (Qwen/Qwen3.5-4B): the tool list first in the system turn, the system prompt after it; calls as
    ``<function=name>`` with one ``<parameter=key>`` block per argument (objects and lists as JSON, other values
    as text); results as Qwen's, trimmed.
    """

    def system_block(self, system: str, tools: ToolList) -> str:
        listed = "".join("\n" + to_json(tool) for tool in tools)
        tail = "\n\n" + system.strip() if system.strip() else ""
        return f"<|im_start|>system\n{QWEN3_5_TOOLS_INTRO}{listed}{QWEN3_5_TOOLS_OUTRO}{tail}<|im_end|>\n"

    def calls(self, calls: list[Call], turn: int) -> str:
        blocks = []
        for call in calls:
            arguments = named_arguments(call, "Qwen3.5", "named parameters")
            written = "".join(f"<parameter={key}>\n{qwen35_value(value)}\n</parameter>\n"
                              for key, value in arguments.items())
            blocks.append(f"<tool_call>\n<function={call['name']}>\n{written}</function>\n</tool_call>")
        return "\n".join(blocks)

    def result(self, content: str, turn: int, call_count: int) -> str:
        return super().result(content.strip(), turn, call_count)


def qwen35_value(value: Any) -> str:
    """An argument as Qwen3.5's template writes it: objects and lists with ``tojson``, the rest with ``string``."""
    if isinstance(value, dict | list):
        return to_json(value)
    return value if isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Llama3Tools(ToolStyle):
    """Llama 3.1+ (meta-llama/Llama-3.1-8B-Instruct): an "Environment: ipython" system block with the
    knowledge/today dates, the tool list in the first user message, calls as JSON with "parameters",
    results as the ipython role. The official template serialises a string result with ``tojson`` (a
    jinja string is iterable), so results are written as JSON strings.
    """

    def system_block(self, system: str, tools: ToolList) -> str:
        return (LLAMA3_HEADER.format(role="system") + "Environment: ipython\nCutting Knowledge Date: December 2023\n"
                f"Today Date: {LLAMA3_DATE}\n\n{system.strip()}<|eot_id|>")

    def user_content(self, content: str, tools: ToolList, is_first: bool, is_last: bool) -> str:
        if not is_first:
            return content
        listed = "".join(to_json(tool, indent=4) + "\n\n" for tool in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                f"arguments that best answers the given prompt.\n\n{LLAMA3_CALL_RULE}{listed}{content}")

    def calls(self, calls: list[Call], turn: int) -> str:
        call = single_call(calls, "Llama 3.1")
        return f'{{"name": "{call["name"]}", "parameters": {to_json(arguments_object(call))}}}'

    def result(self, content: str, turn: int, call_count: int) -> str:
        return (LLAMA3_HEADER.format(role="ipython") + to_json(content) + "<|eot_id|>"
                + LLAMA3_HEADER.format(role="assistant"))


def mistral_call_id(turn: int, index: int) -> str:
    """The official v0.3 template requires 9-character alphanumeric call ids; LLaMA-Factory data has none,
    so they are derived from the turn (ask/answer pair index) and the call's place in it: deterministic,
    and each result names the call it answers.
    """
    return f"{turn:06d}{index:03d}"


@dataclass(frozen=True)
class MistralTools(ToolStyle):
    """Mistral-7B-Instruct-v0.3: [AVAILABLE_TOOLS] before the last user message, [TOOL_CALLS] with call
    ids and eos, [TOOL_RESULTS] echoing the id. A turn with several calls takes its results as a JSON list,
    one per call, written as one [TOOL_RESULTS] block each.
    """

    def before_user(self, tools: ToolList, is_first: bool, is_last: bool) -> str:
        if not is_last:
            return ""
        return "[AVAILABLE_TOOLS] [" + ", ".join(self.tool_text(tool["function"]) for tool in tools) + \
            "][/AVAILABLE_TOOLS]"

    @staticmethod
    def tool_text(function: dict[str, Any]) -> str:
        # The official template writes string values unescaped and everything else with tojson.
        fields = [f'"{key}": "{value}"' if isinstance(value, str) else f'"{key}": {to_json(value)}'
                  for key, value in function.items() if key != "return"]
        return '{"type": "function", "function": {' + ", ".join(fields) + "}}"

    def calls(self, calls: list[Call], turn: int) -> str:
        written = [to_json({"name": call["name"], "arguments": arguments_object(call)})[:-1]
                   + f', "id": "{mistral_call_id(turn, index)}"}}' for index, call in enumerate(calls)]
        return "[TOOL_CALLS] [" + ", ".join(written) + "]"

    def result(self, content: str, turn: int, call_count: int) -> str:
        blocks = [f'[TOOL_RESULTS] {{"content": {text}, '
                  f'"call_id": "{mistral_call_id(turn - 1, index)}"}}[/TOOL_RESULTS]'
                  for index, text in enumerate(results_per_call(content, call_count, "Mistral"))]
        return "".join(blocks)


@dataclass(frozen=True)
class Glm4Tools(ToolStyle):
    """GLM-4-9B-chat: a Chinese system block listing each function (its definition indented by 4), the
    system prompt as a second system turn, a call as "<|assistant|>name\\n{arguments}", a result as
    the observation role. The text is the official jinja as transformers renders it (trim_blocks eats
    one of the two newlines before each "## name"; GLM's remote-code tokenizer and LLaMA-Factory keep both).
    """

    def system_block(self, system: str, tools: ToolList) -> str:
        listed = "".join(f"\n## {tool['function']['name']}\n\n{to_json(tool['function'], indent=4)}{GLM4_CALL_RULE}"
                         for tool in tools)
        return GLM4_TOOLS_INTRO + listed + (f"<|system|>\n{system}" if system else "")

    def calls(self, calls: list[Call], turn: int) -> str:
        call = single_call(calls, "GLM-4")
        return f"{call['name']}\n{to_json(arguments_object(call))}"

    def result(self, content: str, turn: int, call_count: int) -> str:
        return f"<|observation|>\n{content}<|assistant|>"


@dataclass(frozen=True)
class Glm45Tools(ToolStyle):
    """GLM-4.5/4.6 (zai-org/GLM-4.6): the tool list as JSON lines in a system turn of its own before the system
    prompt's, each call as ``<tool_call>name`` with one ``<arg_key>``/``<arg_value>`` pair per argument (objects,
    lists and numbers as JSON, strings as they are), the results of one call turn under one ``<|observation|>``,
    each in ``<tool_response>`` (several calls: the observation is a JSON list, one item per call).
    """

    def system_block(self, system: str, tools: ToolList) -> str:
        listed = "".join(to_json(tool) + "\n" for tool in tools)
        return (f"<|system|>\n{GLM4_5_TOOLS_INTRO}\n{listed}{GLM4_5_TOOLS_OUTRO}"
                + (f"<|system|>\n{system}" if system else ""))

    def calls(self, calls: list[Call], turn: int) -> str:
        blocks = []
        for call in calls:
            arguments = named_arguments(call, "GLM-4.5", "key/value pairs")
            written = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{glm45_value(value)}</arg_value>\n"
                              for key, value in arguments.items())
            blocks.append(f"<tool_call>{call['name']}\n{written}</tool_call>")
        return "\n".join(blocks)

    def result(self, content: str, turn: int, call_count: int) -> str:
        written = "".join(f"\n<tool_response>\n{text}\n</tool_response>"
                          for text in results_per_call(content, call_count, "GLM-4.5"))
        return f"<|observation|>{written}<|assistant|>"


def glm45_value(value: Any) -> str:
    """An argument as GLM-4.5's template writes it: strings as they are, everything else with ``tojson``."""
    return value if isinstance(value, str) else to_json(value)


QWEN_TOOLS = QwenTools("qwen")
QWEN3_5_TOOLS = Qwen35Tools("qwen3_5")
LLAMA3_TOOLS = Llama3Tools("llama3")
MISTRAL_TOOLS = MistralTools("mistral", call_format="{content}{eos}")
GLM4_TOOLS = Glm4Tools("glm4", call_format="{content}")
GLM4_5_TOOLS = Glm45Tools("glm4_moe")
TOOL_FORMATS: dict[str, ToolStyle] = {
    style.name: style for style in (QWEN_TOOLS, QWEN3_5_TOOLS, LLAMA3_TOOLS, MISTRAL_TOOLS, GLM4_TOOLS, GLM4_5_TOOLS)}
