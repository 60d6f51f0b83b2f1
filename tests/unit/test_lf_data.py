"""A LLaMA-Factory data folder used unchanged: every column kind, folders, split/subset, num_samples, mixing,
mask_history, eval_dataset, ranking/KTO entries and hub entries (fetched only when used)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset

from shardtune.data import DataSettings, build_datasets, check_data_settings
from shardtune.data.build import mix_datasets
from shardtune.data.formats import normalize_records
from shardtune.data.loading import load_records, sample_indices
from shardtune.data.registry import resolve_entries
from shardtune.data.settings import IGNORE_INDEX
from shardtune.errors import DataError
from tests.conftest import run_cli
from tests.unit.conftest_data import build_test_tokenizer

ALPACA = [{"instruction": f"Question {i}?", "input": "", "output": f"Answer {i}.", "system": "Be brief.",
           "history": [["Hi", "Hello"]]} for i in range(6)]
SHAREGPT_TOOLS = [{"conversations": [
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
    {"from": "observation", "value": '{"temp": 20}'},
    {"from": "gpt", "value": "It is 20 degrees."}],
    "tools": '[{"name": "weather", "parameters": {"city": "string"}}]'}]
OPENAI = [{"messages": [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Add 2 and 3, and 4 and 5."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}},
        {"type": "function", "function": {"name": "add", "arguments": "{\"a\": 4, \"b\": 5}"}}]},
    {"role": "tool", "content": "5"}, {"role": "tool", "content": "9"},
    {"role": "assistant", "content": "5 and 9."}]}]
CHAT = [{"conversations": [{"from": "human", "value": "First?"}, {"from": "gpt", "value": "One."},
                           {"from": "human", "value": "Second?"}, {"from": "gpt", "value": "Two."}]}]
REGISTRY = {
    "alpaca_full": {"file_name": "alpaca.json", "columns": {"prompt": "instruction", "query": "input",
                                                            "response": "output", "system": "system",
                                                            "history": "history"}},
    "tools_chat": {"file_name": "tools.json", "formatting": "sharegpt",
                   "columns": {"messages": "conversations", "tools": "tools"}},
    "openai_chat": {"file_name": "openai_plain.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant", "system_tag": "system"}},
    "openai_native": {"file_name": "openai.jsonl", "formatting": "openai"},
    "chat": {"file_name": "chat.jsonl", "formatting": "sharegpt"},
    "hub_folder": {"file_name": "hub_copy", "subset": "main", "split": "test"},
    "hub_folder_train": {"file_name": "hub_copy", "subset": "main"},
    "plain_folder": {"file_name": "parts"},
    "sampled": {"file_name": "alpaca.json", "num_samples": 14},
    "pairs": {"file_name": "pairs.json", "ranking": True,
              "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}},
    "kto": {"file_name": "kto.json", "columns": {"kto_tag": "label"}},
    "remote": {"hf_hub_url": "someone/remote-data", "split": "train"},
    "remote_ms": {"ms_hub_url": "someone/ms-data"},
}


def write_json(path: Path, records: list[dict[str, Any]], lines: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(json.dumps(r) for r in records) if lines else json.dumps(records)
    path.write_text(text, encoding="utf-8")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset folder in LLaMA-Factory's layout, written by the test."""
    root = tmp_path_factory.mktemp("lf_data")
    (root / "dataset_info.json").write_text(json.dumps(REGISTRY, indent=2))
    write_json(root / "alpaca.json", ALPACA)
    write_json(root / "tools.json", SHAREGPT_TOOLS)
    write_json(root / "openai.jsonl", OPENAI, lines=True)
    write_json(root / "chat.jsonl", CHAT, lines=True)
    write_json(root / "openai_plain.jsonl", [{"messages": [{"role": "system", "content": "Be kind."},
                                                           {"role": "user", "content": "Hi"},
                                                           {"role": "assistant", "content": "Hello"}]}], lines=True)
    for split, count in (("train-00000-of-00001", 4), ("test", 2)):
        write_json(root / "hub_copy" / "main" / f"{split}.jsonl",
                   [{"instruction": f"{split} {i}", "output": "x"} for i in range(count)], lines=True)
    write_json(root / "hub_copy" / "other" / "train.jsonl", [{"instruction": "other", "output": "y"}], lines=True)
    write_json(root / "parts" / "a.jsonl", [{"instruction": "a", "output": "1"}] * 2, lines=True)
    write_json(root / "parts" / "b.jsonl", [{"instruction": "b", "output": "2"}] * 3, lines=True)
    write_json(root / "pairs.json", [{"instruction": "Q", "chosen": "good", "rejected": "bad"}])
    write_json(root / "kto.json", [{"instruction": "Q", "output": "A", "label": True}])
    return root


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


def settings(folder: Path, *names: str, **kw: Any) -> DataSettings:
    return DataSettings(dataset=names, dataset_dir=str(folder), **kw)


def normalized(folder: Path, name: str) -> Dataset:
    [entry], problems = resolve_entries([name], folder)
    assert problems == []
    return normalize_records(load_records(entry), entry, "sft", None)


def test_every_local_entry_resolves_while_hub_entries_sit_unused(folder: Path) -> None:
    local = [name for name, raw in REGISTRY.items() if "file_name" in raw]
    entries, problems = resolve_entries(local, folder)
    assert problems == [] and len(entries) == len(local)


def test_alpaca_history_and_system_become_turns(folder: Path) -> None:
    record = normalized(folder, "alpaca_full")[0]
    assert record["_system"] == "Be brief." and record["tools"] == ""
    assert [m["role"] for m in record["_messages"]] == ["user", "assistant", "user", "assistant"]
    assert record["_messages"][0]["content"] == "Hi" and record["_messages"][-1]["content"] == "Answer 0."


def test_sharegpt_tool_roles_are_kept_and_tools_passed_through(folder: Path) -> None:
    record = normalized(folder, "tools_chat")[0]
    assert [m["role"] for m in record["_messages"]] == ["user", "function_call", "observation", "assistant"]
    assert record["tools"] == SHAREGPT_TOOLS[0]["tools"]


def test_openai_messages_via_tags_and_native_formatting(folder: Path) -> None:
    via_tags = normalized(folder, "openai_chat")[0]
    assert via_tags["_system"] == "Be kind."
    assert via_tags["_messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    native = normalized(folder, "openai_native")[0]
    assert native["_system"] == "You help."
    roles = [m["role"] for m in native["_messages"]]
    assert roles == ["user", "function_call", "observation", "assistant"]
    calls = json.loads(native["_messages"][1]["content"])
    assert [c["name"] for c in calls] == ["add", "add"]
    assert native["_messages"][2]["content"] == "5\n</tool_response>\n<tool_response>\n9"


def test_folder_file_name_reads_every_file(folder: Path) -> None:
    [entry], _ = resolve_entries(["plain_folder"], folder)
    assert sorted(load_records(entry)["instruction"]) == ["a"] * 2 + ["b"] * 3


def test_subset_and_split_pick_files(folder: Path) -> None:
    [test_entry, train_entry], problems = resolve_entries(["hub_folder", "hub_folder_train"], folder)
    assert problems == []
    assert sorted(load_records(test_entry)["instruction"]) == ["test 0", "test 1"]
    assert len(load_records(train_entry)) == 4
    bad = {"file_name": "hub_copy", "subset": "main", "split": "validation"}
    (folder / "bad").mkdir(exist_ok=True)
    (folder / "bad" / "dataset_info.json").write_text(json.dumps({"v": bad}))
    _, problems = resolve_entries(["v"], folder / "bad")
    assert len(problems) == 1


def test_num_samples_draws_without_then_with_replacement(folder: Path) -> None:
    [entry], _ = resolve_entries(["sampled"], folder)
    records = load_records(entry, seed=3)
    counts = Counter(records["instruction"])
    assert len(records) == 14 and len(counts) == 6 and sum(counts.values()) == 14  # all 6 present, 8 repeats
    few = sample_indices(6, 4, seed=1)
    assert len(few) == len(set(few)) == 4
    assert len(load_records(entry, max_samples=5, seed=3)) == 5  # max_samples applies after num_samples


def test_interleave_proportions_follow_interleave_probs() -> None:
    a = Dataset.from_dict({"x": ["a"] * 2000})
    b = Dataset.from_dict({"x": ["b"] * 2000})
    mixed = mix_datasets([a, b], "interleave_under", (0.8, 0.2), seed=0)
    counts = Counter(mixed["x"])
    assert counts["a"] == 2000  # under: stops when the first dataset runs out
    assert 0.77 < counts["a"] / len(mixed) < 0.83
    small = Dataset.from_dict({"x": ["s"] * 50})
    over = Counter(mix_datasets([small, b], "interleave_over", (0.5, 0.5), seed=0)["x"])
    assert over["b"] == 2000 and over["s"] >= 1900  # over: the small set repeats until the large one is used
    assert Counter(mix_datasets([small, b], "concat", (), seed=0)["x"]) == {"s": 50, "b": 2000}


def test_mask_history_trains_only_the_last_answer(folder: Path, tokenizer: Any) -> None:
    full, _ = build_datasets(tokenizer, settings(folder, "chat"))
    last, _ = build_datasets(tokenizer, settings(folder, "chat", mask_history=True))
    assert full["input_ids"] == last["input_ids"]
    trained = [tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
               for labels in (full["labels"][0], last["labels"][0])]
    assert "One." in trained[0] and "Two." in trained[0]
    assert "One." not in trained[1] and "Two." in trained[1]


def test_eval_dataset_is_what_evaluation_uses(folder: Path, tokenizer: Any) -> None:
    train, evaluation = build_datasets(tokenizer, settings(folder, "alpaca_full", eval_dataset=("plain_folder",)))
    assert len(train) == 6 and evaluation is not None and len(evaluation) == 5
    problems = check_data_settings(settings(folder, "alpaca_full", eval_dataset=("chat",), val_size=0.1))
    assert any("eval_dataset" in p and "val_size" in p for p in problems)


def test_tools_need_a_template_that_renders_them(folder: Path, tokenizer: Any) -> None:
    with pytest.raises(DataError, match="tools"):
        build_datasets(tokenizer, settings(folder, "tools_chat"))  # the default template has no tool format
    train, _ = build_datasets(tokenizer, settings(folder, "tools_chat", template="qwen"))
    assert len(train) == 1


def test_ranking_and_kto_entries_are_validated_and_refused_for_sft(folder: Path) -> None:
    problems = check_data_settings(settings(folder, "pairs", "kto"))
    assert len(problems) == 2
    assert "ranking" in problems[0] and "kto_tag" in problems[1]
    (folder / "bad_rank").mkdir(exist_ok=True)
    (folder / "bad_rank" / "dataset_info.json").write_text(json.dumps({"r": {"file_name": "../pairs.json",
                                                                              "ranking": True}}))
    _, problems = resolve_entries(["r"], folder / "bad_rank")
    assert problems and "chosen/rejected" in problems[0]


def test_setting_checks_name_both_keys(folder: Path) -> None:
    checks = {
        "interleave_probs has 1 values": dict(mix_strategy="interleave_under", interleave_probs=(1.0,)),
        "sum to 1": dict(mix_strategy="interleave_over", interleave_probs=(0.5, 0.6)),
        "only applies to an interleave": dict(interleave_probs=(0.5, 0.5)),
        "mask_history (true) and train_on_prompt": dict(mask_history=True, train_on_prompt=True),
        "neat_packing (true) with stage pt": dict(neat_packing=True, stage="pt"),
    }
    for expected, kw in checks.items():
        problems = check_data_settings(settings(folder, "alpaca_full", "plain_folder", **kw))
        assert any(expected in p for p in problems), (expected, problems)


def test_used_hub_entry_offline_and_not_cached_exits_2_with_one_line(folder: Path, tmp_path: Path) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(f"model_name_or_path: {tmp_path}/tiny-model\nbuild_tiny_model_if_missing: true\n"
                      f"output_dir: {tmp_path}/out\ndataset: alpaca_full,remote\ndataset_dir: {folder}\n")
    result = run_cli("check", str(config), HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
                     HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))  # the hub itself: tests/e2e/test_hub_cli.py
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "'remote'" in lines[0] and "hf_hub_url: someone/remote-data" in lines[0]
    assert "HF_HUB_OFFLINE=1" in lines[0]
