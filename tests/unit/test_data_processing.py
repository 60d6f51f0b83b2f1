"""Truncation to cutoff_len, the all-too-long error, pre-training text, and worker processes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from shardtune.data import DataSettings, build_datasets
from shardtune.data.processing import assemble_sft_sample
from shardtune.errors import DataError
from tests.unit.conftest_data import DATA_DIR, alpaca_dir, build_test_tokenizer, encode, settings_for, write_registry

P1, R1, P2, R2 = [1, 2, 3], [4, 5], [6, 7], [8, 9, 10]
M = -100


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


@pytest.mark.parametrize(("cutoff", "ids", "labels"), [
    (100, P1 + R1 + P2 + R2, [M, M, M, 4, 5, M, M, 8, 9, 10]),  # everything fits
    (8, P1 + R1 + P2 + [8], [M, M, M, 4, 5, M, M, 8]),  # second answer cut, its prompt kept whole
    (7, P1 + R1, [M, M, M, 4, 5]),  # second prompt + one answer token do not fit: stop after turn 1
    (4, P1 + [4], [M, M, M, 4]),  # first answer cut to one token
    (3, [], []),  # first prompt fills the budget: nothing trainable, sample dropped
])
def test_turns_are_truncated_whole_prompt_first(cutoff: int, ids: list[int], labels: list[int]) -> None:
    assert assemble_sft_sample([(P1, R1), (P2, R2)], cutoff, train_on_prompt=False) == (ids, labels)


def test_train_on_prompt_keeps_prompt_labels_when_truncating() -> None:
    assert assemble_sft_sample([(P1, R1), (P2, R2)], 8, train_on_prompt=True) == (P1 + R1 + P2 + [8],) * 2


def test_cutoff_len_truncates_real_samples(tokenizer: Any) -> None:
    settings = DataSettings(dataset=("demo_sharegpt",), dataset_dir=str(DATA_DIR), template="chatml", cutoff_len=64)
    train, _ = build_datasets(tokenizer, settings)
    lengths = [len(ids) for ids in train["input_ids"]]
    assert max(lengths) == 64 and min(lengths) > 0
    assert all(any(label != M for label in labels) for labels in train["labels"])


def test_too_small_cutoff_len_names_the_shortest_sample(tokenizer: Any, tmp_path: Path) -> None:
    records = [{"instruction": "Say hi.", "output": "Hi!"}, {"instruction": "Say hello to everyone.", "output": "Hi"}]
    directory = alpaca_dir(tmp_path, records)
    shortest = len(encode(tokenizer, "<|begin_of_text|>Human: Say hi.\nAssistant:")) + 1
    with pytest.raises(DataError) as caught:
        build_datasets(tokenizer, settings_for(directory, cutoff_len=shortest - 1))
    [problem] = caught.value.problems
    assert problem.startswith(f"cutoff_len ({shortest - 1}) is too small")
    assert f"the shortest sample needs {shortest} tokens" in problem


def test_samples_that_do_not_fit_are_dropped_with_a_warning(tokenizer: Any, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    records = [{"instruction": "Hi", "output": "Hello"}, {"instruction": "word " * 50, "output": "ok"}]
    with caplog.at_level(logging.WARNING, logger="shardtune.data"):
        train, _ = build_datasets(tokenizer, settings_for(alpaca_dir(tmp_path, records), cutoff_len=20))
    assert len(train) == 1
    assert "cutoff_len=20: 0 of 2 samples cut to fit (prompt whole, answers shortened), 1 dropped" in caplog.text


def pt_dir(tmp_path: Path, texts: list[str]) -> Path:
    (tmp_path / "pt.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return write_registry(tmp_path, {"toy": {"file_name": "pt.jsonl", "columns": {"prompt": "text"}}})


def test_pt_without_packing_truncates_each_text(tokenizer: Any, tmp_path: Path) -> None:
    texts = ["A short text.", "A much longer text " * 20, "   "]
    train, _ = build_datasets(tokenizer, settings_for(pt_dir(tmp_path, texts), stage="pt", cutoff_len=16))
    eos = tokenizer.eos_token_id
    assert list(train["input_ids"]) == [encode(tokenizer, texts[0]) + [eos], encode(tokenizer, texts[1])[:16]]
    assert list(train["labels"]) == list(train["input_ids"])


def test_pt_packing_concatenates_texts_into_blocks(tokenizer: Any) -> None:
    settings = DataSettings(dataset=("demo_pt",), dataset_dir=str(DATA_DIR), stage="pt", packing=True,
                            cutoff_len=100, max_samples=30)
    train, _ = build_datasets(tokenizer, settings)
    blocks = [list(ids) for ids in train["input_ids"]]
    assert all(len(block) == 100 for block in blocks[:-1]) and 0 < len(blocks[-1]) <= 100
    assert list(train["labels"]) == blocks
    texts = [json.loads(line)["text"] for line in (DATA_DIR / "demo_pt.jsonl").read_text().splitlines()[:30]]
    stream = [token for text in texts for token in encode(tokenizer, text) + [tokenizer.eos_token_id]]
    assert [token for block in blocks for token in block] == stream


def test_worker_processes_give_the_same_result_and_still_report_bad_records(tokenizer: Any, tmp_path: Path) -> None:
    base = {"dataset": ("demo_sharegpt",), "dataset_dir": str(DATA_DIR), "max_samples": 40, "template": "llama3"}
    single, _ = build_datasets(tokenizer, DataSettings(**base))
    parallel, _ = build_datasets(tokenizer, DataSettings(preprocessing_num_workers=2, **base))
    assert list(parallel["input_ids"]) == list(single["input_ids"])
    records = [{"instruction": f"q{i}", "output": "a" if i != 30 else None} for i in range(40)]
    with pytest.raises(DataError, match=r"record 31 \(line 31\): 'output' is missing"):
        build_datasets(tokenizer, settings_for(alpaca_dir(tmp_path, records), preprocessing_num_workers=2))
