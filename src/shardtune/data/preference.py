"""Preference data (LLaMA-Factory's formats): pairs for dpo and rm, single answers with a verdict for kto.

A ranking entry (``ranking: true``) holds a prompt and two answers. Alpaca style: ``instruction`` (+ ``input``,
``history``, ``system``) and the ``chosen`` / ``rejected`` columns, text. ShareGPT/OpenAI style: the
conversation column ends with a prompt turn and ``chosen`` / ``rejected`` are one answer turn each, in the
entry's tags. A KTO entry is an SFT entry plus its ``kto_tag`` column (true: a desirable answer).

Both answers are rendered through the SFT template path (``Template.render_turns``) with the same prompt, so
their prompt tokens are identical; every prompt token, earlier answers of a multi-turn history included, gets
``IGNORE_INDEX`` (only the final answer is scored, as in LLaMA-Factory). Answers are cut to fit ``cutoff_len``;
when the prompt does not leave room for one answer token the sample is dropped (with ``excess_length_strategy:
drop``, every sample that does not fit whole); one warning counts the samples cut and dropped.
Bad records raise ``DataError`` naming the file and the record index.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from datasets import Dataset, Features, List, Value, concatenate_datasets

from shardtune.data.caching import step_fingerprint
from shardtune.data.columns import (  # noqa: F401 - re-exported: the stage rules live there
    PAIR_STAGES,
    PREFERENCE_STAGES,
    is_preference_stage,
    preference_columns,
    preference_entry_problems,
)
from shardtune.data.formats import (
    CHAT_FEATURES,
    Message,
    RecordError,
    alpaca_to_chat,
    image_column,
    lf_v1_pair_to_chat,
    openai_to_chat,
    raise_record_problems,
    record_files,
    role_map,
    rows,
    sharegpt_to_chat,
    tools_text,
    turn_role_and_content,
)
from shardtune.data.images import ImageProcessor
from shardtune.data.lf_v1_data import V1_FORMATTING
from shardtune.data.processing import report_cutoff, with_image_tokens
from shardtune.data.registry import DatasetEntry
from shardtune.data.settings import IGNORE_INDEX
from shardtune.data.templates import Template
from shardtune.errors import DataError

logger = logging.getLogger(__name__)

_TEXT_CHAT = {key: value for key, value in CHAT_FEATURES.items() if key != "_images"}
PAIR_RECORD_FEATURES = Features({**CHAT_FEATURES, "_rejected": Value("string")})  # pairs may have images
KTO_RECORD_FEATURES = Features({**_TEXT_CHAT, "_kto_tag": Value("bool")})
IDS = List(Value("int32"))
PAIR_FEATURES = Features({"chosen_input_ids": IDS, "chosen_labels": IDS, "rejected_input_ids": IDS,
                          "rejected_labels": IDS})
KTO_FEATURES = Features({"input_ids": IDS, "labels": IDS, "kl_input_ids": IDS, "kl_labels": IDS,
                         "kto_tag": Value("bool")})


# --- records -> normalised columns ---

def normalize_preference_records(records: Dataset, entry: DatasetEntry, stage: str, num_proc: int | None,
                                 batch_size: int = 1000) -> Dataset:
    """``_system``, ``tools``, ``_messages`` (prompt turns then the chosen or only answer) and ``_rejected``
    (pairs) or ``_kto_tag`` (kto); raises DataError listing bad records with the file and index."""
    problems = preference_entry_problems(entry, stage)
    if problems:
        raise DataError(*problems)
    missing = [f"{entry.path}: records have no '{column}' column (dataset '{entry.name}', stage {stage}, found: "
               f"{', '.join(records.column_names) or 'none'}); rename it or set columns.{key} in dataset_info.json"
               for key, column in preference_columns(entry, stage).items() if column not in records.column_names]
    if missing:
        raise DataError(*missing)
    if stage == "kto":
        convert: Callable[..., dict[str, list[Any]]] = partial(convert_kto_batch, entry=entry)
        features = KTO_RECORD_FEATURES
    else:
        convert, features = partial(convert_pair_batch, entry=entry), PAIR_RECORD_FEATURES
    normalized = records.map(convert, batched=True, with_indices=True, remove_columns=records.column_names,
                             features=features, num_proc=num_proc, batch_size=batch_size,
                             desc=f"Reading {entry.name}", new_fingerprint=step_fingerprint(records, stage, convert))
    raise_record_problems(entry.path, [p for p in normalized["_problem"] if p], record_files(entry))
    return normalized.remove_columns("_problem")


def chat_converter(entry: DatasetEntry) -> Callable[[Mapping[str, Any]], tuple[str, list[Message]]]:
    converters = {"sharegpt": sharegpt_to_chat, "openai": openai_to_chat}
    if entry.formatting in converters:
        return partial(converters[entry.formatting], columns=entry.columns, tags=entry.tags)
    return partial(alpaca_to_chat, columns=entry.columns)


def pair_to_chat(record: Mapping[str, Any], entry: DatasetEntry) -> tuple[str, list[Message], str]:
    """(system, prompt turns + the chosen answer, the rejected answer's text) of one ranking record."""
    columns = entry.columns
    for key in ("chosen", "rejected"):
        if record.get(columns[key]) in (None, "", {}):
            raise RecordError(f"'{columns[key]}' is missing or empty: a pair needs a chosen and a rejected answer")
    if entry.formatting == V1_FORMATTING:  # two whole conversations
        return lf_v1_pair_to_chat(record, columns, entry.tags)
    if entry.formatting == "alpaca":
        system, messages = alpaca_to_chat(record, {**columns, "response": columns["chosen"]})
        return system, messages, answer_text(record[columns["rejected"]], columns["rejected"], entry)
    conversation = record.get(columns["messages"])
    if not isinstance(conversation, list):
        raise RecordError(f"'{columns['messages']}' must be a list of turns")
    with_chosen = {**record, columns["messages"]: [*conversation, record[columns["chosen"]]]}
    system, messages = chat_converter(entry)(with_chosen)
    return system, messages, answer_text(record[columns["rejected"]], columns["rejected"], entry)


def answer_text(value: Any, column: str, entry: DatasetEntry) -> str:
    """An answer of a pair: text (alpaca) or one answer turn in the entry's tags (sharegpt, openai)."""
    if entry.formatting == "alpaca":
        if not isinstance(value, str):
            raise RecordError(f"'{column}' must be text, got {type(value).__name__}")
        return value
    role, content = turn_role_and_content(value, 0, role_map(entry.tags), entry.tags)
    if role not in ("assistant", "function_call"):
        raise RecordError(f"'{column}' must be an answer turn ('{entry.tags['assistant_tag']}'), got role '{role}'")
    return content


def convert_pair_batch(batch: Mapping[str, list[Any]], indices: list[int], entry: DatasetEntry
                       ) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"_system": [], "_messages": [], "tools": [], "_rejected": [], "_images": [],
                                 "_problem": []}
    images = image_column(entry)
    for index, record in zip(indices, rows(batch), strict=True):
        try:
            system, messages, rejected = pair_to_chat(record, entry)
            tools, problem = tools_text(record.get(entry.columns["tools"]), entry.columns["tools"]), ""
            paths = images.paths(record, messages) if images is not None else []
        except RecordError as err:
            system, messages, rejected, tools, paths = "", [], "", "", []
            problem = f"record {index + 1}: {err}"
        for key, value in (("_system", system), ("_messages", messages), ("tools", tools), ("_rejected", rejected),
                           ("_images", paths), ("_problem", problem)):
            out[key].append(value)
    return out


def kto_tag(value: Any, column: str) -> bool:
    if not isinstance(value, bool):
        raise RecordError(f"'{column}' must be true or false, got {value!r}")
    return value


def convert_kto_batch(batch: Mapping[str, list[Any]], indices: list[int], entry: DatasetEntry
                      ) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"_system": [], "_messages": [], "tools": [], "_kto_tag": [], "_problem": []}
    to_chat, columns = chat_converter(entry), entry.columns
    for index, record in zip(indices, rows(batch), strict=True):
        try:
            system, messages = to_chat(record)
            tag = kto_tag(record.get(columns["kto_tag"]), columns["kto_tag"])
            tools, problem = tools_text(record.get(columns["tools"]), columns["tools"]), ""
        except RecordError as err:
            system, messages, tag, tools = "", [], False, ""
            problem = f"record {index + 1}: {err}"
        for key, value in (("_system", system), ("_messages", messages), ("tools", tools), ("_kto_tag", tag),
                           ("_problem", problem)):
            out[key].append(value)
    return out


# --- tokenisation ---

def tokenize_preference(dataset: Dataset, tokenizer: Any, template: Template, stage: str, cutoff_len: int,
                        num_proc: int | None = None, batch_size: int = 1000, images: ImageProcessor | None = None,
                        drop_excess: bool = False) -> Dataset:
    """Encode normalised preference records; answers are cut to fit, and samples whose prompt leaves no room for
    an answer (with ``drop_excess``: every sample that does not fit whole) are dropped. With ``images`` (pairs
    only) each pair keeps its images' paths: both rows hold the prompt and so the images."""
    if stage == "kto":
        dataset = with_kl_answers(dataset, num_proc)
        encode = partial(encode_kto_batch, tokenizer=tokenizer, template=template, cutoff_len=cutoff_len,
                         drop_excess=drop_excess)
    else:
        encode = partial(encode_pair_batch, tokenizer=tokenizer, template=template, cutoff_len=cutoff_len,
                         images=images, drop_excess=drop_excess)
    features = Features({**(KTO_FEATURES if stage == "kto" else PAIR_FEATURES), "_cut": Value("bool")})
    if images is not None:
        features = Features({**features, "images": List(Value("string"))})
    first = "input_ids" if stage == "kto" else "chosen_input_ids"
    encoded = dataset.map(encode, batched=True, remove_columns=dataset.column_names, features=features,
                          num_proc=num_proc, batch_size=batch_size, desc="Tokenizing",
                          new_fingerprint=step_fingerprint(dataset, f"{stage}-tokens", encode))
    kept = encoded.filter(lambda ids: [len(x) > 0 for x in ids], batched=True, input_columns=first,
                          num_proc=num_proc, desc="Truncating")
    if len(kept) == 0 and len(encoded) > 0:
        needs = "fits whole (excess_length_strategy: drop)" if drop_excess else "keeps its whole prompt plus one " \
            "answer token"
        raise DataError(f"cutoff_len ({cutoff_len}) is too small: no {stage} sample {needs}; raise cutoff_len")
    report_cutoff(len(encoded), kept, cutoff_len, drop_excess)
    return kept.remove_columns("_cut")


def with_kl_answers(dataset: Dataset, num_proc: int | None = None) -> Dataset:
    """``dataset`` with ``_kl_answer``: the next record's answer (the last takes the first's). Rotating the whole
    dataset, not each map batch, is what keeps every record from meeting its own answer: reversing a batch left
    the middle record of an odd-sized batch, and a batch of one, with its own (so KL = its own log-ratio)."""
    if len(dataset) < 2:
        raise DataError(f"kto needs at least 2 samples ({len(dataset)} given): its KL estimate pairs each prompt "
                        "with another sample's answer; add samples")
    answers = dataset.map(final_answers, batched=True, input_columns="_messages", remove_columns=dataset.column_names,
                          num_proc=num_proc, desc="KL answers")
    rotated = answers.select([*range(1, len(answers)), 0]).flatten_indices()
    return concatenate_datasets([dataset, rotated], axis=1)


def final_answers(messages: list[list[Message]]) -> dict[str, list[str]]:
    return {"_kl_answer": [split_prompt(turns)[1] for turns in messages]}


def preference_sample_fits(dataset: Dataset, tokenizer: Any, template: Template, stage: str, cutoff_len: int,
                           drop_excess: bool = False, batch: int = 64) -> bool:
    """Whether any sample of ``dataset`` keeps its prompt plus one answer token (with ``drop_excess``: fits whole;
    see ``sft_sample_fits``)."""
    encoder = encode_kto_batch if stage == "kto" else encode_pair_batch
    first = "input_ids" if stage == "kto" else "chosen_input_ids"
    for start in range(0, len(dataset), batch):
        encoded = encoder(dataset[start:start + batch], tokenizer=tokenizer, template=template, cutoff_len=cutoff_len,
                          drop_excess=drop_excess)
        if any(encoded[first]):
            return True
    return False


Encoded = tuple[list[int], list[int]]  # (input_ids, labels) of one row
EMPTY: Encoded = ([], [])


def encode_answer_sets(tokenizer: Any, template: Template, samples: Sequence[tuple[str, list[Message], list[str], str]],
                       cutoff_len: int, images: ImageProcessor | None = None,
                       sample_images: Sequence[list[str]] = ()) -> list[tuple[list[Encoded], list[bool]]]:
    """For each (system, prompt turns, answers, tools): (input_ids, labels) of the prompt followed by each answer,
    and for each answer whether cutoff_len cut it.

    Every answer is rendered as the conversation's last turn, so all answers of a sample share its prompt tokens;
    all pieces of all samples are tokenised in one call. A sample whose prompt leaves no room for one answer token
    within ``cutoff_len`` gets empty lists (dropped later); answers are cut to fit.
    """
    rendered = [[[piece for turn in template.render_turns(system, [*prompt, {"role": "assistant", "content": answer}],
                                                          tokenizer, tools) for piece in turn] for answer in answers]
                for system, prompt, answers, tools in samples]
    flat = [piece for sample in rendered for answer in sample for piece in answer]
    flat_ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    if images is not None:  # every answer repeats the prompt, and so its images
        paths = [path for sample, own in zip(rendered, sample_images, strict=True) for _ in sample for path in own]
        flat_ids = with_image_tokens(flat, flat_ids, paths, images)
    ids = iter(flat_ids)
    encoded = []
    for sample in rendered:
        pieces = [[next(ids) for _ in answer] for answer in sample]
        answers = [assemble_answer(answer, cutoff_len) for answer in pieces]
        cut = [sum(len(piece) for piece in answer) > cutoff_len for answer in pieces]
        encoded.append((answers if all(a[0] for a in answers) else [EMPTY for _ in answers], cut))
    return encoded


def assemble_answer(pieces: list[list[int]], cutoff_len: int) -> Encoded:
    """The prompt pieces masked, then the last piece (the answer) cut to ``cutoff_len``; empty when it cannot fit."""
    prompt_ids = [token for piece in pieces[:-1] for token in piece]
    room = cutoff_len - len(prompt_ids)
    if room < 1:
        return EMPTY
    response = pieces[-1][:room]
    return prompt_ids + response, [IGNORE_INDEX] * len(prompt_ids) + response


def split_prompt(messages: Sequence[Message]) -> tuple[list[Message], str]:
    """The turns before the final answer, and the final answer's text."""
    return list(messages[:-1]), messages[-1]["content"]


def encode_pair_batch(batch: Mapping[str, list[Any]], tokenizer: Any, template: Template, cutoff_len: int,
                      images: ImageProcessor | None = None, drop_excess: bool = False) -> dict[str, list[Any]]:
    """Both rows of each pair (``_cut``: an answer was cut; with ``drop_excess`` such a pair is left empty)."""
    tools = batch.get("tools") or [""] * len(batch["_messages"])
    samples = []
    for system, messages, rejected, sample_tools in zip(batch["_system"], batch["_messages"], batch["_rejected"],
                                                         tools, strict=True):
        prompt, chosen = split_prompt(messages)
        samples.append((system, prompt, [chosen, rejected], sample_tools or ""))
    sample_images = batch.get("_images") or [[] for _ in samples]
    out: dict[str, list[Any]] = {key: [] for key in [*PAIR_FEATURES, "_cut"]}
    for answers, cut in encode_answer_sets(tokenizer, template, samples, cutoff_len, images, sample_images):
        (c_ids, c_labels), (r_ids, r_labels) = [EMPTY, EMPTY] if drop_excess and any(cut) else answers
        for key, value in (("chosen_input_ids", c_ids), ("chosen_labels", c_labels), ("rejected_input_ids", r_ids),
                           ("rejected_labels", r_labels), ("_cut", any(cut))):
            out[key].append(value)
    if images is not None:  # a prompt is never cut, so a kept pair keeps every image
        out["images"] = [list(paths) for paths in sample_images]
    return out


def encode_kto_batch(batch: Mapping[str, list[Any]], tokenizer: Any, template: Template, cutoff_len: int,
                     drop_excess: bool = False) -> dict[str, list[Any]]:
    """Each answer, and for KTO's KL estimate the same prompt with another record's answer: ``_kl_answer``
    (``with_kl_answers``), or, where a batch comes without it (the cutoff check), the batch's answers rotated.
    ``_cut`` and ``drop_excess`` look at the trained answer only: the KL row is cut as needed, never trained."""
    tools = batch.get("tools") or [""] * len(batch["_messages"])
    answers = [split_prompt(messages)[1] for messages in batch["_messages"]]
    kl_answers = batch.get("_kl_answer") or answers[1:] + answers[:1]
    samples = [(system, split_prompt(messages)[0], [answer, kl_answer], sample_tools or "")
               for system, messages, sample_tools, answer, kl_answer
               in zip(batch["_system"], batch["_messages"], tools, answers, kl_answers, strict=True)]
    out: dict[str, list[Any]] = {key: [] for key in [*KTO_FEATURES, "_cut"]}
    encoded = encode_answer_sets(tokenizer, template, samples, cutoff_len)
    for (answer_rows, cut), tag in zip(encoded, batch["_kto_tag"], strict=True):
        (ids, labels), (kl_ids, kl_labels) = [EMPTY, EMPTY] if drop_excess and cut[0] else answer_rows
        for key, value in (("input_ids", ids), ("labels", labels), ("kl_input_ids", kl_ids),
                           ("kl_labels", kl_labels), ("kto_tag", tag), ("_cut", cut[0])):
            out[key].append(value)
    return out
