"""Findings from tokenising the same records with LLaMA-Factory's data pipeline and shardtune's (issue 42, point 9):
KTO's KL rows, Llama 3 pre-training rows, GLM-4's role tokens, the `deepseekr1` and `zephyr` templates, and what
`cutoff_len` cuts or drops (`excess_length_strategy`, with the counts the run reports)."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from shardtune.config.load import build_config
from shardtune.data import DataSettings, build_datasets
from shardtune.data.processing import SftOptions, encode_sft_batch
from shardtune.data.settings import IGNORE_INDEX
from shardtune.data.templates import get_template
from shardtune.errors import ConfigError
from tests.unit.conftest_data import DATA_DIR, build_test_tokenizer

Q1, A1, Q2, A2 = "What is 2+2?", "4", "And 3+3?", "It is 6."
MULTI = [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1},
         {"role": "user", "content": Q2}, {"role": "assistant", "content": A2}]
GLM_TOKENS = ["<|user|>", "<|assistant|>", "<|observation|>", "<|system|>", "[gMASK]", "<sop>"]
R1_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


def tokenizer_with(tokens: list[str], eos: str | None = None) -> Any:
    """A copy of the test tokenizer that knows ``tokens`` as single special tokens (and another eos)."""
    extended = copy.deepcopy(build_test_tokenizer())
    extended.add_special_tokens({"additional_special_tokens": tokens})
    if eos is not None:
        extended.eos_token = eos
    return extended


def write_dataset(folder: Path, records: list[dict[str, Any]], entry: dict[str, Any]) -> Path:
    (folder / "records.json").write_text(json.dumps(records), encoding="utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({"set": {"file_name": "records.json", **entry}}))
    return folder


def trained_text(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    return tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])


# --- KTO: the KL row pairs each prompt with another row's answer ---

KTO = {"columns": {"prompt": "instruction", "response": "output", "kto_tag": "kto_tag"}}


@pytest.mark.parametrize(("rows", "batch_size"), [(5, 5), (5, 2), (3, 1000)])
def test_no_kto_row_meets_its_own_answer_in_the_kl_row(tokenizer: Any, tmp_path: Path, rows: int,
                                                       batch_size: int) -> None:
    """LLaMA-Factory's comment: mismatched pairs. Reversing an odd-sized map batch left its middle row (and a last
    batch of one row) with its own answer, which makes the KL estimate the row's own log-ratio."""
    records = [{"instruction": f"Question {k}", "output": f"Answer {k}.", "kto_tag": k % 2 == 0} for k in range(rows)]
    folder = write_dataset(tmp_path, records, KTO)
    train, _ = build_datasets(tokenizer, DataSettings(dataset=("set",), dataset_dir=str(folder), template="chatml",
                                                      stage="kto", preprocessing_batch_size=batch_size))
    kl_answers = []
    for row, record in zip(train, records, strict=True):
        own = trained_text(tokenizer, row["input_ids"], row["labels"])
        kl = trained_text(tokenizer, row["kl_input_ids"], row["kl_labels"])
        assert own.startswith(record["output"]) and not kl.startswith(record["output"])
        kl_answers.append(kl)
    assert len(set(kl_answers)) == rows  # every answer serves as a KL answer once


def test_a_kto_dataset_of_one_row_is_refused(tokenizer: Any, tmp_path: Path) -> None:
    folder = write_dataset(tmp_path, [{"instruction": "Q", "output": "A", "kto_tag": True}], KTO)
    with pytest.raises(Exception, match="another sample's answer"):
        build_datasets(tokenizer, DataSettings(dataset=("set",), dataset_dir=str(folder), template="chatml",
                                               stage="kto"))


# --- Llama 3 pre-training: documents end with <|end_of_text|>, not the chat stop token ---

@pytest.mark.parametrize("packing", [False, True])
def test_llama3_pretraining_documents_end_with_end_of_text(packing: bool) -> None:
    """Llama 3 Instruct's tokenizer has eos <|eot_id|> (the chat stop token); between documents the base model
    saw <|end_of_text|>, as LLaMA-Factory writes for template llama3."""
    instruct = tokenizer_with([], eos="<|eot_id|>")
    train, _ = build_datasets(instruct, DataSettings(dataset=("demo_pt",), dataset_dir=str(DATA_DIR),
                                                     template="llama3", stage="pt", cutoff_len=4096, packing=packing))
    end_of_text, eot = instruct.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    rows = [row["input_ids"] for row in train]
    assert all(eot not in ids for ids in rows)
    if packing:
        assert sum(ids.count(end_of_text) for ids in rows) > 1
    else:
        assert all(ids[-1] == end_of_text for ids in rows)


def test_other_templates_end_pretraining_documents_with_eos(tokenizer: Any) -> None:
    train, _ = build_datasets(tokenizer, DataSettings(dataset=("demo_pt",), dataset_dir=str(DATA_DIR),
                                                      template="chatml", stage="pt", cutoff_len=4096))
    assert all(row["input_ids"][-1] == tokenizer.eos_token_id for row in train)


# --- GLM-4: the role token that ends an answer is trained ---

def encode_one(tokenizer: Any, name: str, messages: list[dict[str, str]], tools: str = "",
               **options: Any) -> tuple[list[int], list[int]]:
    batch = {"_system": [""], "_messages": [messages], "tools": [tools]}
    out = encode_sft_batch(batch, tokenizer, get_template(name), SftOptions(cutoff_len=4096, **options))
    return out["input_ids"][0], out["labels"][0]


@pytest.mark.parametrize("name", ["glm4", "glm4_moe"])
def test_glm4_trains_the_user_token_that_ends_an_answer(name: str) -> None:
    """GLM-4 writes no end-of-turn token: the model stops by generating <|user|> (or <|observation|>), which
    LLaMA-Factory trains (efficient_eos). Only the first turn's <|user|> is prompt."""
    glm = tokenizer_with(GLM_TOKENS)
    ids, labels = encode_one(glm, name, MULTI)
    user = glm.convert_tokens_to_ids("<|user|>")
    first, second = [k for k, token in enumerate(ids) if token == user]
    assert labels[first] == IGNORE_INDEX and labels[second] == user
    assert trained_text(glm, ids, labels).count("<|user|>") == 1
    assert glm.decode(ids) == "".join(p + r for p, r in get_template(name).render_turns("", MULTI, glm))


def test_glm4_trains_the_observation_token_after_a_tool_call() -> None:
    glm = tokenizer_with(GLM_TOKENS)
    call = {"name": "add", "arguments": {"a": 3, "b": 3}}
    chat = [{"role": "user", "content": Q2}, {"role": "function", "content": json.dumps(call)},
            {"role": "observation", "content": "6"}, {"role": "assistant", "content": A2}]
    tools = json.dumps([{"name": "add", "description": "Add", "parameters": {"type": "object", "properties": {}}}])
    ids, labels = encode_one(glm, "glm4", chat, tools)
    observation = glm.convert_tokens_to_ids("<|observation|>")
    (position,) = [k for k, token in enumerate(ids) if token == observation]
    assert labels[position] == observation


def test_glm4_history_stays_masked_with_mask_history() -> None:
    glm = tokenizer_with(GLM_TOKENS)
    ids, labels = encode_one(glm, "glm4", MULTI, mask_history=True)
    assert trained_text(glm, ids, labels) == f"\n{A2}<|end_of_text|>"


# --- templates users have that were missing: zephyr, deepseekr1 ---

# zephyr and deepseekr1 are also compared with their official templates in test_templates_lf.py (OFFICIAL).

def test_deepseekr1_keeps_the_last_reasoning_and_drops_earlier_ones() -> None:
    """The official template drops reasoning from every answer it shows and its generation prompt opens the think
    block; the answer after the last question carries the block (its opener masked), as the model writes it."""
    r1 = tokenizer_with(R1_TOKENS)
    plain = get_template("deepseekr1").render_turns("", MULTI, r1)
    assert plain[1][1] == f"\n</think>\n\n{A2}<｜end▁of▁sentence｜>"
    reasoned = [MULTI[0], {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, MULTI[2],
                {"role": "assistant", "content": f"<think>\nadd again\n</think>\n\n{A2}"}]
    turns = get_template("deepseekr1").render_turns("", reasoned, r1)
    assert turns[0][1] == "4<｜end▁of▁sentence｜>"
    assert turns[1] == (f"<｜User｜>{Q2}<｜Assistant｜><think>\n", f"add again\n</think>\n\n{A2}<｜end▁of▁sentence｜>")
    no_think = get_template("deepseekr1", enable_thinking=False).render_turns("", reasoned, r1)
    assert no_think[1] == (f"<｜User｜>{Q2}<｜Assistant｜><think>\n\n</think>\n\n", f"{A2}<｜end▁of▁sentence｜>")


# --- cutoff_len: cut answers, dropped rows, and the counts the run reports ---

RANKING = {"ranking": True, "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}}
LONG = "word " * 60
PAIRS = [{"instruction": "Hi", "chosen": LONG, "rejected": "No."},  # fits once its answer is cut
         {"instruction": "Hi", "chosen": "Hello there.", "rejected": "No."},  # fits whole
         {"instruction": LONG, "chosen": "Yes.", "rejected": "No."}]  # its prompt alone does not fit


def pair_settings(folder: Path, **extra: Any) -> DataSettings:
    return DataSettings(dataset=("set",), dataset_dir=str(folder), template="chatml", stage="dpo", cutoff_len=40,
                        **extra)


def test_a_pair_whose_prompt_fits_keeps_its_answers_cut_and_the_run_counts_it(
        tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = write_dataset(tmp_path, PAIRS, RANKING)
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        train, _ = build_datasets(tokenizer, pair_settings(folder))
    assert len(train) == 2 and len(train[0]["chosen_input_ids"]) == 40
    assert trained_text(tokenizer, train[0]["chosen_input_ids"], train[0]["chosen_labels"]).startswith("word word")
    assert "cutoff_len=40: 1 of 3 samples cut to fit (prompt whole, answers shortened), 1 dropped" in caplog.text


def test_excess_length_strategy_drop_drops_every_pair_that_does_not_fit_whole(
        tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = write_dataset(tmp_path, PAIRS, RANKING)
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        train, _ = build_datasets(tokenizer, pair_settings(folder, excess_length_strategy="drop"))
    assert len(train) == 1
    assert trained_text(tokenizer, train[0]["chosen_input_ids"], train[0]["chosen_labels"]).startswith("Hello")
    assert "cutoff_len=40: 2 of 3 samples dropped (excess_length_strategy: drop)" in caplog.text


@pytest.mark.parametrize("mask_history", [False, True])
def test_excess_length_strategy_drop_applies_to_sft_samples(tokenizer: Any, tmp_path: Path,
                                                            mask_history: bool) -> None:
    records = [{"instruction": "Hi", "output": LONG}, {"instruction": "Hi", "output": "Hello there."}]
    folder = write_dataset(tmp_path, records, {})
    base = DataSettings(dataset=("set",), dataset_dir=str(folder), template="chatml", cutoff_len=40,
                        mask_history=mask_history)
    truncated, _ = build_datasets(tokenizer, base)
    assert [len(row["input_ids"]) for row in truncated][0] == 40 and len(truncated) == 2
    dropped, _ = build_datasets(tokenizer, DataSettings(**{**base.__dict__, "excess_length_strategy": "drop"}))
    assert len(dropped) == 1 and trained_text(tokenizer, dropped[0]["input_ids"], dropped[0]["labels"]).startswith(
        "Hello")


def test_excess_length_strategy_is_validated_by_the_schema() -> None:
    base = {"model_name_or_path": "org/model", "dataset": "demo", "output_dir": "out"}
    assert build_config({**base, "excess_length_strategy": "drop"}).excess_length_strategy == "drop"
    with pytest.raises(ConfigError) as info:
        build_config({**base, "excess_length_strategy": "cut"})
    (problem,) = info.value.problems
    assert problem.startswith("config: excess_length_strategy: 'cut' is not allowed; choose one of: truncate, drop")
