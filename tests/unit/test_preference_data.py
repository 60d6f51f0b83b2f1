"""Preference data: LLaMA-Factory's ranking (alpaca, sharegpt, multi-turn history) and KTO formats, prompt
masking, one batch per pair, and malformed pairs reported with the file and record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardtune.data import DataCollator, DataSettings, build_datasets, check_data_settings
from shardtune.data.collator import PairCollator
from shardtune.data.settings import IGNORE_INDEX
from shardtune.errors import DataError
from tests.unit.conftest_data import DATA_DIR, build_test_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


def settings(dataset: str, stage: str = "dpo", dataset_dir: str | Path = DATA_DIR, cutoff_len: int = 256,
             **extra: Any) -> DataSettings:
    return DataSettings(dataset=(dataset,), dataset_dir=str(dataset_dir), template="chatml", stage=stage,
                        cutoff_len=cutoff_len, **extra)


def decode_trained(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    return tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])


def prompt_part(ids: list[int], labels: list[int]) -> list[int]:
    return [t for t, label in zip(ids, labels, strict=True) if label == IGNORE_INDEX]


@pytest.mark.parametrize("dataset", ["demo_dpo", "demo_dpo_sharegpt"])
def test_pairs_share_the_prompt_and_train_only_the_answers(tokenizer: Any, dataset: str) -> None:
    train, _ = build_datasets(tokenizer, settings(dataset))
    records = json.loads((DATA_DIR / "demo_dpo.json").read_text())
    assert len(train) == (48 if dataset == "demo_dpo" else 16)
    for row, record in zip(train, records, strict=False):
        chosen = decode_trained(tokenizer, row["chosen_input_ids"], row["chosen_labels"])
        rejected = decode_trained(tokenizer, row["rejected_input_ids"], row["rejected_labels"])
        assert chosen.startswith(record["chosen"]) and rejected.startswith(record["rejected"])
        assert prompt_part(row["chosen_input_ids"], row["chosen_labels"]) == prompt_part(
            row["rejected_input_ids"], row["rejected_labels"])
        prompt = tokenizer.decode(prompt_part(row["chosen_input_ids"], row["chosen_labels"]))
        assert record["instruction"] in prompt
        for question, answer in record.get("history", []):  # earlier turns are context, never trained
            assert question in prompt and answer in prompt and answer not in chosen


def test_alpaca_and_sharegpt_pairs_encode_the_same(tokenizer: Any) -> None:
    alpaca, _ = build_datasets(tokenizer, settings("demo_dpo"))
    sharegpt, _ = build_datasets(tokenizer, settings("demo_dpo_sharegpt"))
    for a, s in zip(alpaca, sharegpt, strict=False):
        assert a == s


def test_kto_rows_carry_the_tag_and_a_mismatched_kl_answer(tokenizer: Any) -> None:
    train, _ = build_datasets(tokenizer, settings("demo_kto", stage="kto"))
    records = json.loads((DATA_DIR / "demo_kto.json").read_text())
    assert [row["kto_tag"] for row in train] == [r["kto_tag"] for r in records]
    for i, row in enumerate(train):
        assert decode_trained(tokenizer, row["input_ids"], row["labels"]).startswith(records[i]["output"])
        # The KL row: the same prompt, another record's answer (the next record's; the last takes the first's).
        assert prompt_part(row["kl_input_ids"], row["kl_labels"]) == prompt_part(row["input_ids"], row["labels"])
        kl_answer = decode_trained(tokenizer, row["kl_input_ids"], row["kl_labels"])
        assert kl_answer.startswith(records[(i + 1) % len(records)]["output"])


def test_pair_collator_puts_chosen_rows_then_rejected_rows(tokenizer: Any) -> None:
    train, _ = build_datasets(tokenizer, settings("demo_dpo"))
    features = [train[i] for i in range(3)]
    batch = PairCollator(DataCollator(tokenizer.pad_token_id, attn_implementation="sdpa"))(features)
    assert batch["pairs"] == 3 and batch["input_ids"].shape[0] == 6
    for i, f in enumerate(features):
        for row, side in ((i, "chosen"), (i + 3, "rejected")):
            n = len(f[f"{side}_input_ids"])
            assert batch["input_ids"][row, :n].tolist() == f[f"{side}_input_ids"]
            assert batch["labels"][row, :n].tolist() == f[f"{side}_labels"]
            assert (batch["labels"][row, n:] == IGNORE_INDEX).all() and batch["attention_mask"][row, n:].sum() == 0


def test_kto_collator_appends_the_kl_rows(tokenizer: Any) -> None:
    train, _ = build_datasets(tokenizer, settings("demo_kto", stage="kto"))
    features = [train[i] for i in range(4)]
    batch = PairCollator(DataCollator(tokenizer.pad_token_id))(features)
    assert batch["input_ids"].shape[0] == 8 and batch["pairs"] == 4
    assert torch.equal(batch["kto_tag"], torch.tensor([f["kto_tag"] for f in features]))


def write_entry(tmp_path: Path, records: list[dict[str, Any]], entry: dict[str, Any], suffix: str = ".json") -> Path:
    path = tmp_path / f"pairs{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"pairs": {"file_name": path.name, **entry}}))
    return path


RANKING = {"ranking": True, "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}}


def test_a_pair_without_a_rejected_answer_names_the_file_and_record(tokenizer: Any, tmp_path: Path) -> None:
    records = [{"instruction": "Hi", "chosen": "Hello.", "rejected": "No."},
               {"instruction": "Add 2 and 2", "chosen": "4.", "rejected": ""}]
    path = write_entry(tmp_path, records, RANKING)
    with pytest.raises(DataError) as err:
        build_datasets(tokenizer, settings("pairs", dataset_dir=tmp_path))
    assert str(path) in str(err.value) and "record 2" in str(err.value) and "'rejected'" in str(err.value)


def test_a_sharegpt_pair_whose_chosen_is_not_an_answer_is_refused(tokenizer: Any, tmp_path: Path) -> None:
    records = [{"conversations": [{"from": "human", "value": "Hi"}], "chosen": {"from": "human", "value": "x"},
                "rejected": {"from": "gpt", "value": "No."}}]
    entry = {"formatting": "sharegpt", "ranking": True,
             "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}
    path = write_entry(tmp_path, records, entry, ".jsonl")
    with pytest.raises(DataError) as err:
        build_datasets(tokenizer, settings("pairs", dataset_dir=tmp_path))
    assert str(path) in str(err.value) and "record 1 (line 1)" in str(err.value)


def test_a_kto_tag_that_is_not_a_boolean_is_refused(tokenizer: Any, tmp_path: Path) -> None:
    records = [{"instruction": "Hi", "output": "Hello.", "kto_tag": "yes"}]
    path = write_entry(tmp_path, records, {"columns": {"prompt": "instruction", "response": "output",
                                                       "kto_tag": "kto_tag"}})
    with pytest.raises(DataError) as err:
        build_datasets(tokenizer, settings("pairs", stage="kto", dataset_dir=tmp_path))
    assert str(path) in str(err.value) and "kto_tag" in str(err.value)


def test_checks_refuse_the_wrong_kind_of_dataset_for_the_stage() -> None:
    assert any("not a ranking dataset" in p for p in check_data_settings(settings("demo", stage="dpo")))
    assert any("no kto_tag column" in p for p in check_data_settings(settings("demo_dpo", stage="kto")))
    assert any("cannot train on" in p for p in check_data_settings(settings("demo_dpo", stage="sft")))
    assert check_data_settings(settings("demo_dpo", stage="rm")) == []
    assert check_data_settings(settings("demo_kto", stage="kto")) == []
    assert any("packing" in p for p in check_data_settings(settings("demo_dpo", packing=True)))


def test_a_prompt_longer_than_cutoff_len_drops_the_pair(tokenizer: Any, tmp_path: Path) -> None:
    records = [{"instruction": "word " * 200, "chosen": "Yes.", "rejected": "No."},
               {"instruction": "Hi", "chosen": "Hello there.", "rejected": "No."}]
    write_entry(tmp_path, records, RANKING)
    train, _ = build_datasets(tokenizer, settings("pairs", dataset_dir=tmp_path, cutoff_len=40))
    assert len(train) == 1
    assert decode_trained(tokenizer, train[0]["chosen_input_ids"], train[0]["chosen_labels"]).startswith("Hello")


def test_group_by_length_measures_a_pair_by_its_longer_row(tokenizer: Any) -> None:
    from shardtune.train.setup import sample_lengths

    train, _ = build_datasets(tokenizer, settings("demo_dpo"))
    lengths = sample_lengths(train)
    assert lengths == [max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in train]
