"""LLaMA-Factory v1's data: its dataset file read as the registry, its own records (typed parts, loss weights)."""

from __future__ import annotations

import json

import pytest

from shardtune.data.formats import RecordError, lf_v1_pair_to_chat, lf_v1_to_chat
from shardtune.data.lf_v1_data import PAIR_COLUMNS, V1_FORMATTING, first_record_problems
from shardtune.data.registry import DEFAULT_COLUMNS, DEFAULT_TAGS, resolve_entries


def turn(role, text, weight):
    return {"role": role, "content": [{"type": "text", "value": text}], "loss_weight": weight}


def to_chat(messages):
    return lf_v1_to_chat({"messages": messages}, DEFAULT_COLUMNS[V1_FORMATTING], DEFAULT_TAGS[V1_FORMATTING])


def test_v1_records_become_conversations():
    system, messages = to_chat([turn("system", "Be brief.", 0.0), turn("user", "Add 2 and 3.", 0.0),
                                turn("assistant", "5.", 1.0), turn("user", "And 4?", 0.0),
                                turn("assistant", "9.", 1.0)])
    assert system == "Be brief."
    assert messages == [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5."},
                        {"role": "user", "content": "And 4?"}, {"role": "assistant", "content": "9."}]


def test_an_image_part_becomes_a_marker_and_its_path_an_image():
    from shardtune.data.lf_v1_data import v1_image_paths, v1_turns

    messages = [{"role": "user", "content": [{"type": "image_url", "value": "a.png"},
                                             {"type": "text", "value": "What is it?"}], "loss_weight": 0.0},
                turn("assistant", "red", 1.0)]
    assert v1_turns(messages)[0]["content"] == "<image>What is it?"
    assert v1_image_paths(messages) == ["a.png"]


@pytest.mark.parametrize(("messages", "reason"), [
    ([turn("user", "hi", 0.0), turn("assistant", "hello", 0.5)], "loss_weight 0.5"),
    ([turn("user", "hi", 1.0), turn("assistant", "hello", 1.0)], r"turn 0 \(user\) has loss_weight 1.0"),
    ([{"role": "user", "content": [{"type": "video_url", "value": "a.mp4"}], "loss_weight": 0.0},
      turn("assistant", "red", 1.0)], "video and audio inputs are not read"),
])
def test_what_shardtune_would_train_differently_is_refused(messages, reason):
    with pytest.raises(RecordError, match=reason):
        to_chat(messages)


def write_v1_data(tmp_path, records, entry_extra=""):
    data = tmp_path / "demo.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    registry = tmp_path / "v1_demo.yaml"
    registry.write_text(f"demo:\n  path: {data}\n  source: local\n{entry_extra}")
    return registry, data


def test_the_v1_dataset_file_is_the_registry(tmp_path):
    registry, data = write_v1_data(tmp_path, [{"messages": [turn("user", "hi", 0.0), turn("assistant", "yo", 1.0)]}],
                                   "  size: 2\n")
    (entry,), problems = resolve_entries(["demo"], registry)
    assert problems == [] and entry.formatting == V1_FORMATTING and entry.path == data and entry.num_samples == 2


def test_hub_and_pair_entries_are_refused_by_name(tmp_path):
    registry = tmp_path / "v1.yaml"
    registry.write_text("hub:\n  path: org/data\npairs:\n  path: p.jsonl\n  source: local\n  converter: pair\n")
    _, problems = resolve_entries(["hub", "pairs"], registry)
    assert "does not download data" in problems[0] and "converter 'pair'" in problems[1]


# --- v1's preference pairs (chosen_messages, rejected_messages: two whole conversations) ---

def pair(prompt, chosen, rejected, rejected_prompt=None):
    return {"chosen_messages": [*prompt, turn("assistant", chosen, 1.0)],
            "rejected_messages": [*(prompt if rejected_prompt is None else rejected_prompt),
                                  turn("assistant", rejected, 1.0)]}


MULTI_TURN = [turn("system", "Be brief.", 0.0), turn("user", "Add 2 and 3.", 0.0), turn("assistant", "5.", 1.0),
              turn("user", "And 4?", 0.0)]


def test_a_v1_pair_file_is_a_ranking_entry_read_as_prompt_chosen_and_rejected(tmp_path):
    registry, data = write_v1_data(tmp_path, [pair(MULTI_TURN, "9.", "10.")])
    (entry,), problems = resolve_entries(["demo"], registry)
    assert problems == [] and entry.ranking and entry.formatting == V1_FORMATTING
    assert (entry.columns["chosen"], entry.columns["rejected"]) == ("chosen_messages", "rejected_messages")
    system, messages, rejected = lf_v1_pair_to_chat(pair(MULTI_TURN, "9.", "10."), entry.columns, entry.tags)
    assert system == "Be brief." and rejected == "10."
    assert messages == [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5."},
                        {"role": "user", "content": "And 4?"}, {"role": "assistant", "content": "9."}]
    assert first_record_problems(data, "demo") == []


@pytest.mark.parametrize(("record", "reason"), [
    (pair([turn("user", "Add 2 and 3.", 0.0)], "5.", "6.", [turn("user", "Add 2 and 4.", 0.0)]),
     r"differ before their answers \(turn 0\)"),
    (pair(MULTI_TURN, "9.", "10.", MULTI_TURN[:2]), r"differ before their answers \(turn 2\)"),
    ({"chosen_messages": [turn("user", "hi", 0.0)], "rejected_messages": [turn("user", "hi", 0.0)]},
     "'chosen_messages' must end with the answer"),
    ({"chosen_messages": [], "rejected_messages": [turn("assistant", "x", 1.0)]},
     "'chosen_messages': must be a non-empty list"),
    (pair([{"role": "user", "content": [{"type": "image_url", "value": "a.png"}], "loss_weight": 0.0}], "x", "y"),
     "images in v1 pairs are not read"),
])
def test_a_pair_that_shardtune_cannot_read_as_one_prompt_is_refused(record, reason):
    with pytest.raises(RecordError, match=reason):
        lf_v1_pair_to_chat(record, {**DEFAULT_COLUMNS[V1_FORMATTING], **PAIR_COLUMNS}, DEFAULT_TAGS[V1_FORMATTING])


def test_check_names_a_bad_first_pair_before_training(tmp_path):
    _, data = write_v1_data(tmp_path, [pair([turn("user", "a", 0.0)], "x", "y", [turn("user", "b", 0.0)])])
    assert "record 1: chosen_messages and rejected_messages differ" in first_record_problems(data, "demo")[0]


def test_pairs_encode_with_one_prompt_and_a_bad_record_names_its_file_and_line(tmp_path):
    from shardtune.data import DataSettings, build_datasets
    from shardtune.errors import DataError
    from tests.unit.conftest_data import build_test_tokenizer

    tokenizer = build_test_tokenizer()
    good = pair([turn("user", "Add 2 and 3.", 0.0)], "5.", "6.")
    registry, data = write_v1_data(tmp_path, [good, good])
    settings = DataSettings(dataset=("demo",), dataset_dir=str(registry), template="chatml", stage="dpo",
                            cutoff_len=256)
    train, _ = build_datasets(tokenizer, settings)
    row = train[0]
    prompt = [t for t, label in zip(row["chosen_input_ids"], row["chosen_labels"], strict=True) if label == -100]
    assert prompt == [t for t, label in zip(row["rejected_input_ids"], row["rejected_labels"], strict=True)
                      if label == -100]
    assert "Add 2 and 3." in tokenizer.decode(prompt)
    assert tokenizer.decode([t for t in row["rejected_labels"] if t != -100]).startswith("6.")
    bad = pair([turn("user", "Add 2 and 3.", 0.0)], "5.", "6.", [turn("user", "Add 3 and 3.", 0.0)])
    registry, data = write_v1_data(tmp_path, [good, bad])
    with pytest.raises(DataError) as err:
        build_datasets(tokenizer, settings)
    assert str(data) in str(err.value) and "line 2" in str(err.value) and "differ before" in str(err.value)


def test_v1_image_paths_are_read_from_the_working_directory_as_v1_reads_them(tmp_path, monkeypatch):
    """LLaMA-Factory's data/v1_multimodal_demo.yaml names ``path: data/v1_multimodal_demo.jsonl`` and its records
    ``data/mllm_demo_data/1.jpg``, both from the working directory (where ``llamafactory-cli`` runs); joined to the
    dataset file's folder the images were looked for in data/data/mllm_demo_data."""
    from PIL import Image

    from shardtune.data.formats import image_column, lf_v1_to_chat

    (tmp_path / "data" / "mllm_demo_data").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "data" / "mllm_demo_data" / "1.png")
    record = {"messages": [{"role": "user", "content": [{"type": "image_url", "value": "data/mllm_demo_data/1.png"},
                                                        {"type": "text", "value": "Who?"}], "loss_weight": 0.0},
                           turn("assistant", "Them.", 1.0)]}
    (tmp_path / "data" / "v1_multimodal_demo.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "data" / "v1_multimodal_demo.yaml").write_text(
        "v1_multimodal_demo:\n  path: data/v1_multimodal_demo.jsonl\n  source: local\n")
    monkeypatch.chdir(tmp_path)
    (entry,), problems = resolve_entries(["v1_multimodal_demo"], "data/v1_multimodal_demo.yaml")
    column = image_column(entry)
    assert problems == [] and column is not None
    _, messages = lf_v1_to_chat(record, entry.columns, entry.tags)
    assert column.paths(record, messages) == [str(tmp_path / "data" / "mllm_demo_data" / "1.png")]
