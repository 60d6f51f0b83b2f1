"""Templates: exact token ids and label masks for a known 2-turn chat, per template."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from shardtune.data import TEMPLATES, build_datasets, get_template
from shardtune.errors import DataError
from tests.unit.conftest_data import (
    build_test_tokenizer,
    encode,
    expected_ids_and_labels,
    settings_for,
    write_jsonl,
    write_registry,
)

SYSTEM, Q1, A1, Q2, A2 = "Be brief.", "What is 2+2?", "4", "And 3+3?", "It is 6."
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHATML = [
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n",
    f"{A1}<|im_end|>\n",
    f"<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n",
    f"{A2}<|im_end|>\n",
]
# The literal (prompt, response, prompt, response) text each template must produce for the chat above.
EXPECTED_PIECES = {
    "default": [f"System: {SYSTEM}{EOS}\nHuman: {Q1}{EOS}\nAssistant:", f"{A1}{EOS}\n",
                f"Human: {Q2}{EOS}\nAssistant:", f"{A2}{EOS}\n"],
    "alpaca": [f"{SYSTEM}\n\n### Instruction:\n{Q1}\n\n### Response:\n", f"{A1}{EOS}\n\n",
               f"### Instruction:\n{Q2}\n\n### Response:\n", f"{A2}{EOS}\n\n"],
    "chatml": CHATML,
    "qwen": CHATML,
    "llama3": [
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{Q1}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        f"{A1}<|eot_id|>",
        f"<|start_header_id|>user<|end_header_id|>\n\n{Q2}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        f"{A2}<|eot_id|>",
    ],
    "auto": CHATML,  # the test tokenizer's chat_template is chatml
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


def chat_dir(tmp_path: Path, system: str | None = SYSTEM) -> Path:
    turns = [{"from": "human", "value": Q1}, {"from": "gpt", "value": A1},
             {"from": "human", "value": Q2}, {"from": "gpt", "value": A2}]
    if system is not None:
        turns.insert(0, {"from": "system", "value": system})
    write_jsonl(tmp_path / "chat.jsonl", [{"conversations": turns}])
    return write_registry(tmp_path, {"toy": {"file_name": "chat.jsonl", "formatting": "sharegpt"}})


def build_single(tokenizer: Any, directory: Path, **overrides: Any) -> tuple[list[int], list[int]]:
    train, _ = build_datasets(tokenizer, settings_for(directory, **overrides))
    return list(train[0]["input_ids"]), list(train[0]["labels"])




def test_every_expected_name_is_a_template() -> None:
    assert set(EXPECTED_PIECES) <= set(TEMPLATES)  # the rest are in test_templates_lf.py


@pytest.mark.parametrize("name", sorted(EXPECTED_PIECES))
def test_template_ids_and_label_mask(tokenizer: Any, tmp_path: Path, name: str) -> None:
    ids, labels = build_single(tokenizer, chat_dir(tmp_path), template=name)
    assert (ids, labels) == expected_ids_and_labels(tokenizer, EXPECTED_PIECES[name])


@pytest.mark.parametrize("name", ["chatml", "llama3", "default"])
def test_special_tokens_are_single_ids_and_the_stop_token_is_trained(tokenizer: Any, tmp_path: Path,
                                                                     name: str) -> None:
    ids, labels = build_single(tokenizer, chat_dir(tmp_path), template=name)
    text = "".join(EXPECTED_PIECES[name])
    for token in ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>"):
        assert ids.count(tokenizer.convert_tokens_to_ids(token)) == text.count(token), token
    stop_id = tokenizer.convert_tokens_to_ids(get_template(name).stop_token(tokenizer))
    assert labels.count(stop_id) == 2  # one per answer, trained


def test_qwen_adds_its_default_system_prompt(tokenizer: Any, tmp_path: Path) -> None:
    ids, _ = build_single(tokenizer, chat_dir(tmp_path, system=None), template="qwen")
    default = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    expected = f"<|im_start|>system\n{default}<|im_end|>\n" + "".join(CHATML)[
        len(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"):]
    assert ids == encode(tokenizer, expected)
    ids, _ = build_single(tokenizer, chat_dir(tmp_path, system=None), template="chatml")
    assert tokenizer.decode(ids).startswith("<|im_start|>user\n")


def test_train_on_prompt_trains_every_token(tokenizer: Any, tmp_path: Path) -> None:
    ids, labels = build_single(tokenizer, chat_dir(tmp_path), template="llama3", train_on_prompt=True)
    assert labels == ids


def test_auto_without_chat_template_is_a_data_error(tokenizer: Any, tmp_path: Path) -> None:
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DataError, match="template 'auto' needs the tokenizer's chat_template"):
        build_datasets(bare, settings_for(chat_dir(tmp_path), template="auto"))


def test_auto_rejects_templates_that_rewrite_earlier_turns(tokenizer: Any, tmp_path: Path) -> None:
    forgetful = copy.deepcopy(tokenizer)
    forgetful.chat_template = "{{ messages[-1]['content'] }}"
    with pytest.raises(DataError, match="renders earlier turns differently"):
        build_datasets(forgetful, settings_for(chat_dir(tmp_path), template="auto"))


def test_get_template_suggests_a_name() -> None:
    with pytest.raises(DataError, match=r"unknown template 'lama3' \(did you mean 'llama3'\?\)"):
        get_template("lama3")


def test_stop_tokens(tokenizer: Any) -> None:
    stops = {name: TEMPLATES[name].stop_token(tokenizer) for name in EXPECTED_PIECES}
    assert stops == {"default": EOS, "alpaca": EOS, "chatml": "<|im_end|>", "qwen": "<|im_end|>",
                     "llama3": "<|eot_id|>", "auto": EOS}


def test_content_with_placeholders_stays_literal(tokenizer: Any) -> None:
    turns = get_template("default").render_turns("", [{"role": "user", "content": "say {eos} {content}"},
                                                      {"role": "assistant", "content": "{bos}"}], tokenizer)
    assert turns == [(f"Human: say {{eos}} {{content}}{EOS}\nAssistant:", f"{{bos}}{EOS}\n")]
