"""LLaMA-Factory v1's data: its dataset file read as the registry, its own records (typed parts, loss weights)."""

from __future__ import annotations

import json

import pytest

from shardtune.data.formats import RecordError, lf_v1_to_chat
from shardtune.data.lf_v1_data import V1_FORMATTING, first_record_problems
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


def test_check_names_v1_preference_pairs_before_training(tmp_path):
    _, data = write_v1_data(tmp_path, [{"chosen_messages": [], "rejected_messages": []}])
    assert "v1 preference pairs" in first_record_problems(data, "demo")[0]
