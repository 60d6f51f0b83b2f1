"""Tool definitions and tool calls as the official chat templates write them.

The dataset's ``tools`` column is a JSON string: a list of function definitions
(``{"name", "description", "parameters"}``, or OpenAI's ``{"type": "function", "function": ...}``).
A tool-call answer is the JSON ``{"name", "arguments"}`` or a list of them (LLaMA-Factory's shape).
JSON is written as jinja's ``tojson`` in transformers writes it: ``json.dumps`` with non-ASCII kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shardtune.errors import DataError

QWEN_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def parse_tools(text: str) -> list[dict[str, Any]]:
    """The function definitions in a ``tools`` string ("" or "[]" means none)."""
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


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
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


@dataclass(frozen=True)
class ToolStyle:
    """How one family writes the tool list (inside the system turn) and the assistant's tool calls."""

    name: str
    system_open: str
    system_close: str
    observation_format: str  # a tool result, ending with the assistant header

    def system_block(self, system: str, tools: list[dict[str, Any]]) -> str:
        """The system turn that carries ``system`` (already defaulted by the template) and the tool list."""
        listed = "".join("\n" + to_json(tool) for tool in tools)
        lead = system + "\n\n" if system else ""
        return f"{self.system_open}{lead}{QWEN_TOOLS_INTRO}{listed}{QWEN_TOOLS_OUTRO}{self.system_close}"

    def calls(self, calls: list[dict[str, Any]]) -> str:
        """Tool calls as answer text, one ``<tool_call>`` block per call, newline separated."""
        blocks = []
        for call in calls:
            arguments = call["arguments"]
            written = arguments if isinstance(arguments, str) else to_json(arguments)
            blocks.append(f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {written}}}\n</tool_call>')
        return "\n".join(blocks)


# Qwen2.5 and Qwen3 (Hermes-style calls): results go back as a user turn wrapped in <tool_response>.
QWEN_TOOLS = ToolStyle(
    "qwen", "<|im_start|>system\n", "<|im_end|>\n",
    "<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
)
TOOL_FORMATS = {"qwen": QWEN_TOOLS}
