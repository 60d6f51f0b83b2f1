"""Loading files of every type, record formats, bad records, max_samples and the eval split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from shardtune.data import DataSettings, build_datasets
from shardtune.errors import DataError
from tests.unit.conftest_data import (
    DATA_DIR,
    alpaca_dir,
    build_test_tokenizer,
    encode,
    settings_for,
    write_jsonl,
    write_registry,
)

RECORDS = [
    {"instruction": "Add the numbers.", "input": "2, 3", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "Hi!"},
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


def build_one(tokenizer: Any, settings: DataSettings) -> list[list[int]]:
    train, evaluation = build_datasets(tokenizer, settings)
    assert evaluation is None
    return [list(ids) for ids in train["input_ids"]]


def test_json_jsonl_csv_and_parquet_give_the_same_tokens(tokenizer: Any, tmp_path: Path) -> None:
    frame = pd.DataFrame(RECORDS)
    (tmp_path / "t.json").write_text(json.dumps(RECORDS))
    write_jsonl(tmp_path / "t.jsonl", RECORDS)
    frame.to_csv(tmp_path / "t.csv", index=False)  # "5" comes back as a number: must still be text
    frame.to_parquet(tmp_path / "t.parquet")
    kinds = ("json", "jsonl", "csv", "parquet")
    write_registry(tmp_path, {kind: {"file_name": f"t.{kind}"} for kind in kinds})
    results = [build_one(tokenizer, settings_for(tmp_path, kind)) for kind in kinds]
    assert len(results[0]) == 3
    assert all(result == results[0] for result in results)
    assert tokenizer.decode(results[0][0]) == (
        "Human: Add the numbers.\n2, 3<|end_of_text|>\nAssistant:5<|end_of_text|>\n"
    )


def test_malformed_jsonl_line_is_reported_with_its_number(tokenizer: Any, tmp_path: Path) -> None:
    directory = alpaca_dir(tmp_path, RECORDS)
    lines = (tmp_path / "toy.jsonl").read_text().splitlines()
    lines.insert(2, '{"instruction": "broken", "output": ')
    (tmp_path / "toy.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as caught:
        build_datasets(tokenizer, settings_for(directory))
    [problem] = caught.value.problems
    assert problem.startswith(f"{tmp_path / 'toy.jsonl'} line 3: not valid JSON (")


def test_json_array_syntax_error_is_reported_with_its_line(tokenizer: Any, tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps(RECORDS, indent=1).replace('"Hi!"', '"Hi!",'))
    write_registry(tmp_path, {"toy": {"file_name": "t.json"}})
    with pytest.raises(DataError, match=r"t\.json line \d+: not valid JSON"):
        build_datasets(tokenizer, settings_for(tmp_path))


def test_missing_columns_name_the_column_and_the_mapping_key(tokenizer: Any, tmp_path: Path) -> None:
    records = [{"question": "Say hi.", "answer": "Hi!"}]
    directory = alpaca_dir(tmp_path, records)
    with pytest.raises(DataError) as caught:
        build_datasets(tokenizer, settings_for(directory))
    assert [p.split(" (")[0] for p in caught.value.problems] == [
        f"{tmp_path / 'toy.jsonl'}: records have no 'instruction' column",
        f"{tmp_path / 'toy.jsonl'}: records have no 'output' column",
    ]
    directory = alpaca_dir(tmp_path, records, columns={"prompt": "question", "response": "answer"})
    assert len(build_one(tokenizer, settings_for(directory))) == 1


def test_bad_alpaca_records_are_listed_by_index(tokenizer: Any, tmp_path: Path) -> None:
    records = [*RECORDS, {"instruction": "No answer", "input": "", "output": None},
               {"instruction": "", "input": "", "output": "x"}, {"instruction": "q", "output": "a", "history": "x"}]
    with pytest.raises(DataError) as caught:
        build_datasets(tokenizer, settings_for(alpaca_dir(tmp_path, records)))
    problems = caught.value.problems
    # records are numbered from 1, with the line each starts on (one JSON object per line here)
    assert [p.split(":")[0] for p in problems] == [f"{tmp_path / 'toy.jsonl'} record {i} (line {i})" for i in (4, 5, 6)]
    assert "'output' is missing" in problems[0] and "'history' must be a list" in problems[2]


def sharegpt_dir(tmp_path: Path, conversations: list[list[dict[str, str]]], **entry: Any) -> Path:
    write_jsonl(tmp_path / "chat.jsonl", [{"conversations": c} for c in conversations])
    return write_registry(tmp_path, {"toy": {"file_name": "chat.jsonl", "formatting": "sharegpt", **entry}})


def turn(role: str, value: str) -> dict[str, str]:
    return {"from": role, "value": value}


def test_sharegpt_roles_must_alternate(tokenizer: Any, tmp_path: Path) -> None:
    good = [turn("human", "Hi"), turn("gpt", "Hello")]
    directory = sharegpt_dir(tmp_path, [
        good,
        [turn("human", "Hi"), turn("human", "Anyone?"), turn("gpt", "Yes")],
        [turn("human", "Hi"), turn("gpt", "Hello"), turn("human", "Bye")],
        [turn("bot", "Hi"), turn("gpt", "Hello")],
        [turn("human", "Hi"), turn("system", "Be nice"), turn("gpt", "Hello")],
    ])
    with pytest.raises(DataError) as caught:
        build_datasets(tokenizer, settings_for(directory))
    problems = caught.value.problems
    path = tmp_path / "chat.jsonl"
    assert [p.split(":")[0] for p in problems] == [f"{path} record {i} (line {i})" for i in (2, 3, 4, 5)]
    assert "turn 1 should be 'gpt' but is 'human'" in problems[0]
    assert "last turn must be an answer" in problems[1]
    assert "role 'bot'" in problems[2] and "tags.user_tag" in problems[2]


def test_sharegpt_custom_tags_and_system_turn(tokenizer: Any, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    write_registry(tmp_path, {"toy": {"file_name": "chat.jsonl", "formatting": "sharegpt",
                                      "columns": {"messages": "messages"}, "tags": tags}})
    [ids] = build_one(tokenizer, settings_for(tmp_path, template="chatml"))
    assert ids == encode(tokenizer, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                    "<|im_start|>assistant\nHello<|im_end|>\n")


def test_alpaca_system_and_history_become_turns(tokenizer: Any, tmp_path: Path) -> None:
    record = {"instruction": "And 3+3?", "input": "", "output": "6", "system": "Be brief.",
              "history": [["What is 2+2?", "4"]]}
    [ids] = build_one(tokenizer, settings_for(alpaca_dir(tmp_path, [record]), template="chatml"))
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n"
    )


def test_max_samples_applies_per_dataset_and_datasets_concatenate(tokenizer: Any) -> None:
    settings = DataSettings(dataset=("demo", "demo_sharegpt"), dataset_dir=str(DATA_DIR), max_samples=7)
    assert len(build_one(tokenizer, settings)) == 14
    assert len(build_one(tokenizer, DataSettings(dataset="demo,demo_sharegpt", dataset_dir=str(DATA_DIR)))) == 500


def test_val_size_fraction_and_count(tokenizer: Any) -> None:
    base = {"dataset": ("demo",), "dataset_dir": str(DATA_DIR), "max_samples": 50}
    train, evaluation = build_datasets(tokenizer, DataSettings(val_size=0.1, **base))
    assert (len(train), len(evaluation)) == (45, 5)
    train_again, evaluation_again = build_datasets(tokenizer, DataSettings(val_size=0.1, **base))
    assert list(evaluation["input_ids"]) == list(evaluation_again["input_ids"])  # same seed, same split
    _, other = build_datasets(tokenizer, DataSettings(val_size=0.1, seed=7, **base))
    assert list(other["input_ids"]) != list(evaluation["input_ids"])
    train, evaluation = build_datasets(tokenizer, DataSettings(val_size=12, **base))
    assert (len(train), len(evaluation)) == (38, 12)
    all_ids = sorted(map(tuple, list(train["input_ids"]) + list(evaluation["input_ids"])))
    assert all_ids == sorted(map(tuple, build_one(tokenizer, DataSettings(**base))))
    with pytest.raises(DataError, match=r"val_size \(50\) holds out 50 samples but only 50 remain"):
        build_datasets(tokenizer, DataSettings(val_size=50, **base))


def test_packed_eval_split(tokenizer: Any) -> None:
    settings = DataSettings(dataset=("demo",), dataset_dir=str(DATA_DIR), max_samples=60, val_size=10,
                            packing=True, cutoff_len=1024)
    train, evaluation = build_datasets(tokenizer, settings)
    assert sum(max(s) for s in evaluation["segment_ids"]) == 10
    assert sum(max(s) for s in train["segment_ids"]) == 50
