"""LLaMA-Factory v1's data: its dataset file (YAML) read as a registry, and its records read as conversations.

A v1 dataset file names each dataset with ``path`` (a local file, relative to the working directory as v1 reads
it), ``source: local`` and optionally ``converter`` (``alpaca``, ``sharegpt``), ``size`` and ``split``. Without a
converter the records are v1's own: ``messages``, each turn ``{"role", "content": [{"type": "text", "value"}],
"loss_weight"}``. ``registry_entries`` turns the file into ``dataset_info.json`` entries (formatting ``lf_v1`` for
v1's own records); ``v1_turns`` turns one record's messages into plain turns for ``formats.openai_to_chat``.

v1's preference pairs (``llamafactory-cli dpo``) hold two whole conversations, ``chosen_messages`` and
``rejected_messages``, which v1 renders one after the other. A file whose first record is such a pair becomes a
ranking entry (columns chosen/rejected): ``v1_pair_turns`` reads a pair as shardtune's pairs are read, the prompt
turns and the chosen answer, and the rejected answer's text; the turns before the two answers must be the same.

shardtune trains every assistant turn and never a prompt turn, so a ``loss_weight`` must say the same (0 on a
prompt turn, 1 on an answer); v1 also splits a multi-turn conversation into one sample per answer, where shardtune
trains all answers of a conversation in one sample (the same tokens, weighted per conversation, not per turn).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from shardtune.data.images import IMAGE_MARKER

V1_FORMATTING = "lf_v1"
CONVERTERS = {"alpaca": "alpaca", "sharegpt": "sharegpt"}
ENTRY_KEYS = ("path", "source", "converter", "size", "split")
ANSWER_ROLES = ("assistant",)
IMAGE_PART = "image_url"  # v1's image part; its value is the image's path
PAIR_COLUMNS = {"chosen": "chosen_messages", "rejected": "rejected_messages"}  # v1's DPOSample


def is_v1_dataset_file(dataset_dir: str | Path) -> bool:
    return Path(dataset_dir).suffix.lower() in (".yaml", ".yml") and Path(dataset_dir).is_file()


def v1_media_dir() -> Path:
    """Where a v1 record's relative ``image_url`` paths start: the working directory, as v1 reads them and its
    dataset file's ``path`` (LLaMA-Factory's data/v1_multimodal_demo.jsonl names ``data/mllm_demo_data/1.jpg``
    beside ``path: data/v1_multimodal_demo.jsonl``), not the dataset file's folder, which would name data/ twice."""
    return Path.cwd()


def load_v1_registry(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The v1 dataset file as ``dataset_info.json`` entries, and its problems (never raises for user mistakes)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        return {}, [f"{path}: cannot read the v1 dataset file: {err}"]
    if not isinstance(raw, dict) or not raw:
        return {}, [f"{path}: a v1 dataset file maps dataset names to entries (path, source, converter)"]
    registry: dict[str, Any] = {}
    problems: list[str] = []
    for name, entry in raw.items():
        converted, entry_problems = registry_entry(f"{path}: dataset '{name}'", entry)
        problems += entry_problems
        if converted is not None:
            registry[str(name)] = converted
    return registry, problems


def registry_entry(where: str, entry: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """One v1 entry as a ``dataset_info.json`` entry."""
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        return None, [f"{where} must be a mapping with a 'path'"]
    unread = [key for key in entry if key not in ENTRY_KEYS]
    if unread:
        return None, [f"{where}: {', '.join(unread)} not read by shardtune (it reads {', '.join(ENTRY_KEYS)}); "
                      "remove it"]
    if entry.get("source", "hf_hub") != "local":
        return None, [f"{where} is read from the hub ({entry['path']}), but shardtune does not download data: "
                      "download it, point path at the local file and set source: local"]
    converter = entry.get("converter")
    if converter is not None and converter not in CONVERTERS:
        return None, [f"{where}: converter '{converter}' is not read by shardtune (pair data: v1's own "
                      "chosen_messages/rejected_messages records, or a dataset_info.json ranking entry); use "
                      "alpaca, sharegpt or none (v1's own records)"]
    converted: dict[str, Any] = {"file_name": str(Path(entry["path"]).absolute()),
                                 "formatting": CONVERTERS[converter] if converter else V1_FORMATTING}
    if entry.get("size") is not None:
        converted["num_samples"] = entry["size"]
    if entry.get("split") is not None:
        converted["split"] = entry["split"]
    if converter is None and holds_pairs(first_record(Path(entry["path"]))):
        converted.update(ranking=True, columns=dict(PAIR_COLUMNS))
    return converted, []


def first_record(path: Path) -> Any:
    """The first record of a JSON-lines file, or None when it cannot be read (the loader names the problem)."""
    try:
        with path.open(encoding="utf-8") as handle:
            first = next((line for line in handle if line.strip()), "")
        return json.loads(first) if first else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def holds_pairs(record: Any) -> bool:
    """Whether ``record`` is one of v1's preference pairs (and not a conversation)."""
    return isinstance(record, dict) and "messages" not in record and set(PAIR_COLUMNS.values()) <= set(record)


def v1_pair_turns(chosen: Any, rejected: Any) -> tuple[list[dict[str, str]], str]:
    """A v1 pair as the chosen conversation's plain turns and the rejected answer's text; ValueError says why not.
    Both conversations end with their answer and share every turn before it."""
    sides = {}
    for column, messages in ((PAIR_COLUMNS["chosen"], chosen), (PAIR_COLUMNS["rejected"], rejected)):
        try:
            turns = v1_turns(messages)
        except ValueError as err:
            raise ValueError(f"'{column}': {str(err).removeprefix(repr('messages') + ' ')}") from None
        if turns[-1]["role"] not in ANSWER_ROLES:
            raise ValueError(f"'{column}' must end with the answer (an assistant turn), got a '{turns[-1]['role']}' "
                             "turn")
        if v1_image_paths(messages):
            raise ValueError(f"'{column}' has {IMAGE_PART} parts: images in v1 pairs are not read; give the pairs as "
                             "a dataset_info.json ranking entry with an images column")
        sides[column] = turns
    prompt, other = sides[PAIR_COLUMNS["chosen"]][:-1], sides[PAIR_COLUMNS["rejected"]][:-1]
    if prompt != other:
        turn = next((n for n, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b),
                    min(len(prompt), len(other)))
        raise ValueError(f"chosen_messages and rejected_messages differ before their answers (turn {turn}): a pair "
                         "shares its prompt turns and differs only in the last; make them the same")
    return sides[PAIR_COLUMNS["chosen"]], sides[PAIR_COLUMNS["rejected"]][-1]["content"]


def v1_turns(messages: Any) -> list[dict[str, str]]:
    """v1 turns (typed content parts, loss weights) as ``{"role", "content"}`` turns; ValueError says why not."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of turns")
    return [plain_turn(number, turn) for number, turn in enumerate(messages)]


def plain_turn(number: int, turn: Any) -> dict[str, str]:
    if not isinstance(turn, dict) or "role" not in turn or not isinstance(turn.get("content"), list):
        raise ValueError(f"turn {number} must have a 'role' and a 'content' list of parts")
    texts = []
    for part in turn["content"]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", IMAGE_PART):
            raise ValueError(f"turn {number} has a '{kind}' part: video and audio inputs are not read (text and "
                             f"{IMAGE_PART} parts are)")
        texts.append(IMAGE_MARKER if kind == IMAGE_PART else str(part.get("value", "")))
    trained = turn["role"] in ANSWER_ROLES
    weight = turn.get("loss_weight", 1.0 if trained else 0.0)
    if weight != (1.0 if trained else 0.0):
        raise ValueError(f"turn {number} ({turn['role']}) has loss_weight {weight}: shardtune trains every answer "
                         "(1) and no prompt turn (0); other weights are not read")
    return {"role": str(turn["role"]), "content": "".join(texts)}


def v1_image_paths(messages: Any) -> list[str]:
    """The values of a v1 record's image parts, in order (each became an ``<image>`` marker in its turn's text)."""
    if not isinstance(messages, list):
        return []
    return [str(part.get("value", "")) for turn in messages if isinstance(turn, dict)
            for part in turn.get("content") or [] if isinstance(part, dict) and part.get("type") == IMAGE_PART]


def first_record_problems(path: Path, name: str) -> list[str]:
    """What would stop v1's own records of dataset ``name`` from being read, judged on the first record (JSON
    lines), so that the launching host says it before any process starts."""
    record = first_record(path)
    if not isinstance(record, dict):
        return []  # the loader names an unreadable file with its line
    try:
        if holds_pairs(record):
            v1_pair_turns(record[PAIR_COLUMNS["chosen"]], record[PAIR_COLUMNS["rejected"]])
        else:
            v1_turns(record.get("messages"))
    except ValueError as err:
        return [f"{path}: dataset '{name}', record 1: {err}"]
    return []
