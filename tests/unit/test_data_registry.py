"""check_data_settings: registry, file and settings problems found without a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.data import DataSettings, build_datasets, check_data_settings
from shardtune.data.registry import separator_hint
from shardtune.errors import DataError
from tests.unit.conftest_data import REPO, alpaca_dir, settings_for, write_jsonl, write_registry

RECORD = {"instruction": "Say hi.", "input": "", "output": "Hi!"}


def test_bundled_demo_registry_is_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert check_data_settings(DataSettings(dataset=("demo", "demo_sharegpt"))) == []
    assert check_data_settings(DataSettings(dataset=("demo_pt",), stage="pt")) == []


def test_unknown_dataset_suggests_the_closest_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    problems = check_data_settings(DataSettings(dataset=("dmo",)))
    assert problems == ["dataset: unknown dataset 'dmo' in data/dataset_info.json (did you mean 'demo'?)"]


def test_unknown_dataset_without_close_match_lists_known_names(tmp_path: Path) -> None:
    directory = alpaca_dir(tmp_path, [RECORD])
    [problem] = check_data_settings(settings_for(directory, "zzzzzz"))
    assert "unknown dataset 'zzzzzz'" in problem and "known: toy" in problem


def test_missing_dataset_dir_and_info_file(tmp_path: Path) -> None:
    [problem] = check_data_settings(settings_for(tmp_path / "nope"))
    assert "dataset_dir" in problem and "nope" in problem
    [problem] = check_data_settings(settings_for(tmp_path))
    assert f"{tmp_path / 'dataset_info.json'} does not exist" in problem


def test_bad_json_in_dataset_info_names_the_line(tmp_path: Path) -> None:
    (tmp_path / "dataset_info.json").write_text('{\n  "toy": {"file_name": "toy.jsonl"}\n  "other": {}\n}\n')
    [problem] = check_data_settings(settings_for(tmp_path))
    assert problem.startswith(f"{tmp_path / 'dataset_info.json'} line 3: not valid JSON")


def test_missing_file_bad_formatting_and_bad_extension_are_all_reported(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "ok.jsonl", [RECORD])
    (tmp_path / "data.txt").write_text("hello\n")
    write_registry(tmp_path, {
        "gone": {"file_name": "missing.jsonl"},
        "fmt": {"file_name": "ok.jsonl", "formatting": "sharegtp"},
        "ext": {"file_name": "data.txt"},
    })
    problems = check_data_settings(settings_for(tmp_path, "gone", "fmt", "ext"))
    assert len(problems) == 3
    assert f"file {tmp_path / 'missing.jsonl'} does not exist" in problems[0]
    assert "formatting 'sharegtp'" in problems[1] and "(did you mean 'sharegpt'?)" in problems[1]
    assert "unsupported extension" in problems[2] and ".parquet" in problems[2]


def test_entry_keys_and_column_keys_are_checked(tmp_path: Path) -> None:
    directory = alpaca_dir(tmp_path, [RECORD], colums={"prompt": "instruction"})
    [problem] = check_data_settings(settings_for(directory))
    assert "unknown key 'colums' (did you mean 'columns'?)" in problem
    directory = alpaca_dir(tmp_path, [RECORD], columns={"respone": "output"})
    [problem] = check_data_settings(settings_for(directory))
    assert "unknown columns key 'respone' (did you mean 'response'?)" in problem


def test_hub_datasets_offline_and_not_cached_are_one_line_with_a_remedy(tmp_path: Path, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    write_registry(tmp_path, {"hub": {"hf_hub_url": "someone/data"}})
    [problem] = check_data_settings(settings_for(tmp_path, "hub"))
    assert "dataset 'hub': hf_hub_url: someone/data is not in the Hugging Face cache" in problem
    assert "hf download someone/data --repo-type dataset" in problem


def test_unknown_template_and_bad_settings(tmp_path: Path) -> None:
    directory = alpaca_dir(tmp_path, [RECORD])
    problems = check_data_settings(settings_for(directory, template="chatm", cutoff_len=0, val_size=1.5, stage="ppo"))
    text = "\n".join(problems)
    assert "unknown template 'chatm' (did you mean 'chatml'?)" in text
    assert "cutoff_len (0)" in text and "val_size (1.5)" in text and "stage 'ppo'" in text


def test_stage_pt_needs_a_text_column(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    [problem] = check_data_settings(DataSettings(dataset=("demo_sharegpt",), stage="pt"))
    assert "stage pt reads plain text" in problem
    directory = alpaca_dir(tmp_path, [{"body": "some text"}], columns={"prompt": "text"})
    [problem] = check_data_settings(settings_for(directory, stage="pt"))
    assert "no 'text' column" in problem and "columns.prompt" in problem


def test_sft_on_plain_text_data_reports_the_missing_answer_column(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    [problem] = check_data_settings(DataSettings(dataset=("demo_pt",)))
    assert "data/demo_pt.jsonl: records have no 'output' column" in problem and "columns.response" in problem


def test_first_record_columns_are_peeked_for_every_file_type(tmp_path: Path) -> None:
    import pandas as pd

    frame = pd.DataFrame([{"question": "q", "answer": "a"}])
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_parquet(tmp_path / "t.parquet")
    (tmp_path / "t.json").write_text(json.dumps([{"question": "q", "answer": "a"}]))
    write_registry(tmp_path, {kind: {"file_name": f"t.{kind}"} for kind in ("csv", "parquet", "json")})
    problems = check_data_settings(settings_for(tmp_path, "csv", "parquet", "json"))
    assert len(problems) == 6 and all("found: question, answer" in p for p in problems)


def test_build_datasets_raises_the_check_problems_together(tmp_path: Path) -> None:
    directory = alpaca_dir(tmp_path, [RECORD])
    with pytest.raises(DataError) as caught:
        build_datasets(None, settings_for(directory, "toy", "tyo", template="nope"))
    assert len(caught.value.problems) == 2


def test_names_joined_by_spaces_or_semicolons_are_told_to_use_commas() -> None:
    registry = {"demo": {}, "demo_sharegpt": {}}
    assert "separated by commas: demo,demo_sharegpt" in separator_hint("demo demo_sharegpt", registry)
    assert "separated by commas: demo,demo_sharegpt" in separator_hint("demo; demo_sharegpt", registry)
    assert separator_hint("demo unknown", registry) == ""


def test_dropping_long_samples_is_refused_where_there_are_no_samples() -> None:
    """pt cuts one text into rows: excess_length_strategy: drop would silently do nothing there."""
    problems = check_data_settings(DataSettings(dataset=("demo_pt",), stage="pt", excess_length_strategy="drop",
                                                dataset_dir=str(REPO / "data")))
    assert any(p.startswith("excess_length_strategy (drop) with stage (pt)") for p in problems)
    assert not any("excess_length_strategy" in p for p in check_data_settings(
        DataSettings(dataset=("demo_pt",), stage="pt", dataset_dir=str(REPO / "data"))))
