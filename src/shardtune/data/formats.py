"""Record formats (alpaca, sharegpt, plain text) normalised into one shape.

Every sft record becomes ``_system: str``, ``tools: str`` (the tool definitions as text, "" when none; the
template renders them) and ``_messages: [{"role", "content"}, ...]``: prompt turns (role ``user`` or
``observation``, a tool's result) alternating with answer turns (``assistant`` or ``function_call``, a tool
call), starting with a prompt and ending with an answer. Every pt record becomes ``_text: str``.
Formattings: alpaca, sharegpt (role tags from ``tags``) and openai (``messages`` with role/content,
``tool_calls`` and ``tool`` results).
Bad records are not dropped silently: each one yields a ``_problem`` line naming the file and the
record index (counting from 0), and the caller raises them together.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, List, Value

from shardtune.data.caching import step_fingerprint
from shardtune.data.columns import missing_column_problems, required_columns  # noqa: F401 - re-exported
from shardtune.data.images import marker_problem, resolve_image_paths
from shardtune.data.lf_v1_data import V1_FORMATTING, v1_image_paths, v1_pair_turns, v1_turns
from shardtune.data.other_format import turn_tags_hint
from shardtune.data.record_places import record_lines
from shardtune.data.registry import DatasetEntry
from shardtune.errors import DataError

Message = dict[str, str]
CHAT_FEATURES = Features({
    "_system": Value("string"),
    "_messages": List({"role": Value("string"), "content": Value("string")}),
    "tools": Value("string"),
    "_images": List(Value("string")),
    "_problem": Value("string"),
})
TEXT_FEATURES = Features({"_text": Value("string"), "_problem": Value("string")})
MAX_LISTED = 5


class RecordError(ValueError):
    """A single record cannot be used; the message says why (the caller adds file and index)."""


def normalize_records(records: Dataset, entry: DatasetEntry, stage: str, num_proc: int | None,
                      batch_size: int = 1000) -> Dataset:
    """Convert raw records of ``entry`` to the normalised columns; raises DataError listing bad records."""
    require_columns(records.column_names, entry, stage)
    convert, features = batch_converter(entry, stage)
    normalized = records.map(convert, batched=True, with_indices=True, remove_columns=records.column_names,
                             features=features, num_proc=num_proc, batch_size=batch_size, desc=f"Reading {entry.name}",
                             new_fingerprint=step_fingerprint(records, "normalize", convert))
    raise_record_problems(entry.path, [p for p in normalized["_problem"] if p], record_files(entry))
    return normalized.remove_columns("_problem")


def batch_converter(entry: DatasetEntry, stage: str) -> tuple[Callable[..., dict[str, list[Any]]], Features]:
    """The batched map function for ``entry`` and the columns it produces."""
    if stage == "pt":
        return partial(convert_text_batch, column=entry.columns["prompt"]), TEXT_FEATURES
    converters = {"sharegpt": sharegpt_to_chat, "openai": openai_to_chat, V1_FORMATTING: lf_v1_to_chat}
    if entry.formatting in converters:
        to_chat = partial(converters[entry.formatting], columns=entry.columns, tags=entry.tags)
    else:
        to_chat = partial(alpaca_to_chat, columns=entry.columns)
    return partial(convert_chat_batch, to_chat=to_chat, tools_column=entry.columns["tools"],
                   images=image_column(entry)), CHAT_FEATURES


def require_columns(found: list[str], entry: DatasetEntry, stage: str) -> None:
    problems = missing_column_problems(found, entry, stage)
    if problems:
        raise DataError(*problems)


def raise_record_problems(path: Path, problems: list[str], files: tuple[Path, ...] = ()) -> None:
    """One line per bad record (``record N: why``), with the line it starts on when the data is one file."""
    if not problems:
        return
    lines = record_lines(files[0]) if len(files) == 1 else []
    listed = [f"{path} {_with_line(p, lines)}" for p in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        listed.append(f"{path}: ... and {len(problems) - MAX_LISTED} more bad records")
    raise DataError(*listed)


def record_files(entry: DatasetEntry) -> tuple[Path, ...]:
    """The files whose record numbers are file positions: all of them unless num_samples drew records at random."""
    return tuple(entry.data_files) if entry.num_samples is None else ()


def _with_line(problem: str, lines: list[int]) -> str:
    """``record 3 (line 17): ...`` when the record's line is known."""
    number = re.match(r"record (\d+):", problem)
    if number is None or not 0 < int(number.group(1)) <= len(lines):
        return problem
    return f"record {number.group(1)} (line {lines[int(number.group(1)) - 1]}):{problem[number.end():]}"


def rows(batch: Mapping[str, list[Any]]) -> list[dict[str, Any]]:
    size = len(next(iter(batch.values()))) if batch else 0
    return [{key: values[i] for key, values in batch.items()} for i in range(size)]


@dataclass(frozen=True)
class ImageColumn:
    """A dataset's images column and the folder its relative paths start from."""

    name: str
    media_dir: Path

    def paths(self, record: Mapping[str, Any], messages: list[Message]) -> list[str]:
        try:
            paths = resolve_image_paths(self.values(record), self.name, self.media_dir)
        except ValueError as err:
            raise RecordError(str(err)) from None
        problem = marker_problem(messages, paths)
        if problem:
            raise RecordError(problem)
        return paths


    def values(self, record: Mapping[str, Any]) -> Any:
        return record.get(self.name)


class V1ImageParts(ImageColumn):
    """LLaMA-Factory v1's images: the ``image_url`` parts of the turns in the messages column ``name``."""

    def values(self, record: Mapping[str, Any]) -> Any:
        return v1_image_paths(record.get(self.name))


def image_column(entry: DatasetEntry) -> ImageColumn | None:
    """Where ``entry``'s records name their images: the images column, or (v1) the image parts of their turns."""
    if entry.formatting == V1_FORMATTING:
        return V1ImageParts(entry.columns["messages"], entry.media_dir)
    return ImageColumn(entry.columns["images"], entry.media_dir) if "images" in entry.columns else None


def convert_chat_batch(batch: Mapping[str, list[Any]], indices: list[int],
                       to_chat: Callable[[Mapping[str, Any]], tuple[str, list[Message]]], tools_column: str,
                       images: ImageColumn | None = None) -> dict[str, list[Any]]:
    """Apply ``to_chat`` to every record of a batch, recording a problem line instead of raising."""
    out: dict[str, list[Any]] = {"_system": [], "_messages": [], "tools": [], "_images": [], "_problem": []}
    for index, record in zip(indices, rows(batch), strict=True):
        try:
            system, messages = to_chat(record)
            tools = tools_text(record.get(tools_column), tools_column)
            paths = images.paths(record, messages) if images is not None else []
            out["_problem"].append("")
        except RecordError as err:
            system, messages, tools, paths = "", [], "", []
            out["_problem"].append(f"record {index + 1}: {err}")
        out["_system"].append(system)
        out["_messages"].append(messages)
        out["tools"].append(tools)
        out["_images"].append(paths)
    return out


def convert_text_batch(batch: Mapping[str, list[Any]], indices: list[int], column: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"_text": [], "_problem": []}
    for index, value in zip(indices, batch[column], strict=True):
        try:
            out["_text"].append(as_text(value, column))
            out["_problem"].append("")
        except RecordError as err:
            out["_text"].append("")
            out["_problem"].append(f"record {index + 1}: {err}")
    return out


def as_text(value: Any, column: str) -> str:
    """Text of one field; numbers are accepted because CSV readers infer numeric columns."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise RecordError(f"'{column}' must be text, got {type(value).__name__}")


def alpaca_to_chat(record: Mapping[str, Any], columns: Mapping[str, str]) -> tuple[str, list[Message]]:
    """instruction (+ "\\n" + input) is the user turn, output the answer, history the earlier turns."""
    instruction = as_text(record.get(columns["prompt"]), columns["prompt"])
    query = as_text(record.get(columns["query"]), columns["query"])
    user = "\n".join(part for part in (instruction, query) if part)
    if not user:
        raise RecordError(f"'{columns['prompt']}' is empty")
    if record.get(columns["response"]) is None:
        raise RecordError(f"'{columns['response']}' is missing")
    answer = as_text(record[columns["response"]], columns["response"])
    messages = history_messages(record.get(columns["history"]), columns["history"])
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return as_text(record.get(columns["system"]), columns["system"]), messages


def history_messages(history: Any, column: str) -> list[Message]:
    if history is None:
        return []
    if not isinstance(history, list) or not all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)
        for pair in history
    ):
        raise RecordError(f"'{column}' must be a list of [question, answer] string pairs")
    messages: list[Message] = []
    for question, answer in history:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


PROMPT_ROLES = ("user", "observation")  # turns at even positions (0-based): what the model reads
ANSWER_ROLES = ("assistant", "function_call")  # turns at odd positions: what the model writes


def role_map(tags: Mapping[str, str]) -> dict[str, str]:
    """Role tag in the data -> normalised role."""
    return {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["observation_tag"]: "observation",
            tags["function_tag"]: "function_call", tags["system_tag"]: "system"}


def conversation_parts(record: Mapping[str, Any], columns: Mapping[str, str], tags: Mapping[str, str]
                       ) -> tuple[list[Any], Mapping[str, str], str]:
    """A conversation record's turns (a non-empty list), its role map and its system column's text."""
    turns = record.get(columns["messages"])
    if not isinstance(turns, list) or not turns:
        raise RecordError(f"'{columns['messages']}' must be a non-empty list of turns")
    return turns, role_map(tags), as_text(record.get(columns["system"]), columns["system"])


def sharegpt_to_chat(record: Mapping[str, Any], columns: Mapping[str, str], tags: Mapping[str, str]
                     ) -> tuple[str, list[Message]]:
    """Map role tags to roles; a leading system turn becomes the system prompt; turns must alternate."""
    turns, roles, system = conversation_parts(record, columns, tags)
    messages: list[Message] = []
    for number, turn in enumerate(turns):
        role, content = turn_role_and_content(turn, number, roles, tags)
        if role == "system" and number == 0:
            system = content
            continue
        messages.append({"role": role, "content": content})
    check_alternation(messages, tags)
    return system, messages


def openai_to_chat(record: Mapping[str, Any], columns: Mapping[str, str], tags: Mapping[str, str]
                   ) -> tuple[str, list[Message]]:
    """OpenAI messages: an assistant turn with ``tool_calls`` becomes a function_call turn holding the calls
    as JSON, and consecutive tool results become one observation turn (as LLaMA-Factory joins them)."""
    turns, roles, system = conversation_parts(record, columns, tags)
    messages: list[Message] = []
    results: list[str] = []
    for number, turn in enumerate(turns):
        calls = turn.get("tool_calls") if isinstance(turn, dict) else None
        if calls:
            turn = {tags["role_tag"]: tags["function_tag"], tags["content_tag"]: tool_calls_text(calls, number)}
        role, content = turn_role_and_content(turn, number, roles, tags)
        if role == "system" and number == 0:
            system = content
        elif role == "observation":
            results.append(content)
            continue
        else:
            messages += observation_turn(results) + [{"role": role, "content": content}]
        results = []
    check_alternation(messages + observation_turn(results), tags)
    return system, messages + observation_turn(results)


def lf_v1_to_chat(record: Mapping[str, Any], columns: Mapping[str, str], tags: Mapping[str, str]
                  ) -> tuple[str, list[Message]]:
    """LLaMA-Factory v1's own records: typed content parts and loss weights read into plain turns first."""
    try:
        turns = v1_turns(record.get(columns["messages"]))
    except ValueError as err:
        raise RecordError(str(err)) from None
    return openai_to_chat({**record, columns["messages"]: turns}, columns, tags)


def lf_v1_pair_to_chat(record: Mapping[str, Any], columns: Mapping[str, str], tags: Mapping[str, str]
                       ) -> tuple[str, list[Message], str]:
    """One of v1's pairs: (system, prompt turns + the chosen answer, the rejected answer's text)."""
    try:
        turns, rejected = v1_pair_turns(record.get(columns["chosen"]), record.get(columns["rejected"]))
    except ValueError as err:
        raise RecordError(str(err)) from None
    system, messages = openai_to_chat({**record, columns["messages"]: turns}, columns, tags)
    return system, messages, rejected


def tool_calls_text(calls: Any, number: int) -> str:
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "function" in c for c in calls):
        raise RecordError(f"message {number}: tool_calls must be a list of objects with a 'function'")
    return json.dumps([call["function"] for call in calls], ensure_ascii=False)


def observation_turn(results: list[str]) -> list[Message]:
    return [{"role": "observation", "content": "\n</tool_response>\n<tool_response>\n".join(results)}] \
        if results else []


def check_alternation(messages: list[Message], tags: Mapping[str, str]) -> None:
    """Prompt turns (user, observation) and answer turns (assistant, function_call) alternate, prompt first,
    answer last, as LLaMA-Factory requires; a record that breaks this is reported, not skipped."""
    for number, message in enumerate(messages):
        allowed = PROMPT_ROLES if number % 2 == 0 else ANSWER_ROLES
        if message["role"] not in allowed:
            names = [tag_of(role, tags) for role in allowed]
            raise RecordError(f"turn {number} should be '{names[0]}' but is '{tag_of(message['role'], tags)}' "
                              f"('{names[1]}' fits there too; counting after a leading system turn, turns must "
                              "alternate prompt/answer)")
    if len(messages) % 2 or not messages:
        raise RecordError(f"the last turn must be an answer ('{tags['assistant_tag']}' or '{tags['function_tag']}')")


def tag_of(role: str, tags: Mapping[str, str]) -> str:
    """The data's tag for a normalised role (``function_call`` -> ``tags["function_tag"]``)."""
    return tags[f"{'function' if role == 'function_call' else role}_tag"]


def tools_text(value: Any, column: str) -> str:
    """The tools column as text: JSON lists/objects (OpenAI style) are serialised, absent is empty."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    raise RecordError(f"'{column}' must be text or a JSON list of tools, got {type(value).__name__}")


def turn_role_and_content(turn: Any, number: int, roles: Mapping[str, str], tags: Mapping[str, str]
                          ) -> tuple[str, str]:
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    other_format = turn_tags_hint(turn, tags)
    if other_format:
        raise RecordError(f"turn {number}: {other_format}")
    if not isinstance(turn, dict) or role_tag not in turn or content_tag not in turn:
        raise RecordError(f"turn {number} must be an object with '{role_tag}' and '{content_tag}' "
                          "(set tags.role_tag/content_tag in dataset_info.json)")
    if turn[role_tag] not in roles:
        raise RecordError(f"turn {number} has role '{turn[role_tag]}'; expected one of {', '.join(roles)} "
                          "(set tags.user_tag/assistant_tag/observation_tag/function_tag/system_tag in "
                          "dataset_info.json)")
    return roles[turn[role_tag]], as_text(turn[content_tag], content_tag)
