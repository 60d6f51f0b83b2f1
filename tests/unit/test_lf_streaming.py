"""``streaming: true``: the streamed data builder against the map-style one, the buffer shuffle, rank shares,
the val_size hold-out, and the settings a stream cannot honour (refused before any work)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardtune.config.load import build_config
from shardtune.data import DataSettings, build_datasets, check_data_settings
from shardtune.data.streaming import build_streams
from shardtune.errors import DataError
from shardtune.launch.validate import cross_key_problems
from shardtune.train.settings import data_settings
from tests.conftest import run_cli
from tests.unit.conftest_data import build_test_tokenizer

REGISTRY = {
    "qa": {"file_name": "qa.jsonl"},
    "chat": {"file_name": "chat.jsonl", "formatting": "sharegpt"},
    "parts": {"file_name": "parts"},
    "texts": {"file_name": "texts.jsonl"},
    "sampled": {"file_name": "qa.jsonl", "num_samples": 5},
    "broken": {"file_name": "broken.jsonl"},
}
QA = [{"instruction": f"Question number {i}?", "input": "", "output": f"Answer {i} is " + "long " * (i % 7)}
      for i in range(40)]
CHAT = [{"conversations": [{"from": "human", "value": f"Hi {i}"}, {"from": "gpt", "value": f"Hello {i}."},
                           {"from": "human", "value": f"Again {i}?"}, {"from": "gpt", "value": "Yes."}]}
        for i in range(10)]
TEXTS = [{"instruction": f"Plain text number {i}. " + "words " * (i % 11)} for i in range(50)]


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream_data")
    (root / "dataset_info.json").write_text(json.dumps(REGISTRY))
    write_lines(root / "qa.jsonl", QA)
    write_lines(root / "chat.jsonl", CHAT)
    write_lines(root / "texts.jsonl", TEXTS)
    for part in range(4):  # four files: split by whole files between 2 or 4 ranks
        write_lines(root / "parts" / f"part-{part}.jsonl", QA[part * 10:(part + 1) * 10])
    write_lines(root / "broken.jsonl", [*QA[:3], {"instruction": "", "output": "no question"}])
    return root


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


def settings(folder: Path, *names: str, **changes: Any) -> DataSettings:
    base = DataSettings(dataset=names, dataset_dir=str(folder), template="chatml", cutoff_len=48, streaming=True,
                        buffer_size=1)
    return replace(base, **changes)


def rows_of(data: Any) -> list[tuple[tuple[int, ...], ...]]:
    """Every row as a hashable tuple of its columns, in order."""
    return [tuple(tuple(row[name]) for name in sorted(row)) for row in data]


@pytest.mark.parametrize("names, changes", [
    (("qa",), {}),
    (("qa", "chat"), {"mask_history": True}),
    (("qa", "chat"), {"train_on_prompt": True, "cutoff_len": 24}),  # some samples are cut, some dropped
    (("texts",), {"stage": "pt", "packing": True, "preprocessing_batch_size": 16}),
    (("texts",), {"stage": "pt", "packing": False, "cutoff_len": 8}),
])
def test_stream_gives_the_map_style_token_ids_and_labels(folder, tokenizer, names, changes) -> None:
    """Buffer 1 keeps a file's records in order, so one file gives the map-style rows one for one; the
    shuffle still draws the order of files (datasets' shards), so several give the same rows as a multiset."""
    chosen = settings(folder, *names, **changes)
    mapped, _ = build_datasets(tokenizer, replace(chosen, streaming=False))
    streamed, evaluation = build_streams(tokenizer, chosen)
    assert evaluation is None and len(mapped) > 0
    if len(names) == 1:
        assert rows_of(streamed) == rows_of(mapped)
    else:
        assert Counter(rows_of(streamed)) == Counter(rows_of(mapped))


def test_packed_sft_rows_hold_the_same_samples(folder, tokenizer) -> None:
    """sft packing works per preprocessing batch; one batch covering all records packs like the map style."""
    chosen = settings(folder, "qa", "chat", packing=True, cutoff_len=64)
    mapped, _ = build_datasets(tokenizer, replace(chosen, streaming=False))
    streamed = list(build_streams(tokenizer, chosen)[0])
    assert Counter(rows_of(streamed)) == Counter(rows_of(mapped))
    assert all(len(row["input_ids"]) <= 64 and max(row["segment_ids"]) >= 1 for row in streamed)
    small_batches = list(build_streams(tokenizer, replace(chosen, preprocessing_batch_size=8))[0])
    tokens = Counter(t for row in small_batches for t in row["input_ids"])
    assert tokens == Counter(t for row in streamed for t in row["input_ids"])  # same samples, other rows


def test_buffer_shuffle_only_reorders(folder, tokenizer) -> None:
    ordered = rows_of(build_streams(tokenizer, settings(folder, "qa"))[0])
    stream = build_streams(tokenizer, settings(folder, "qa", buffer_size=16))[0]
    first = rows_of(stream)
    assert first != ordered and Counter(first) == Counter(ordered)
    assert rows_of(stream) == first  # the same pass again: same order
    stream.set_epoch(1)
    second = rows_of(stream)
    assert second != first and Counter(second) == Counter(ordered)
    # A buffer of b records can move a record at most b - 1 places earlier.
    position = {row: i for i, row in enumerate(ordered)}
    assert all(position[row] <= i + 15 for i, row in enumerate(first))


@pytest.mark.parametrize("name, world", [("qa", 2), ("qa", 3), ("parts", 2), ("parts", 4)])
def test_rank_shares_are_disjoint_and_cover_the_stream(folder, tokenizer, name, world) -> None:
    """One file: every world-size-th record; four files: whole files per rank. Either way a partition."""
    chosen = settings(folder, name, buffer_size=8)
    whole = Counter(rows_of(build_streams(tokenizer, chosen)[0]))
    shares = [Counter(rows_of(build_streams(tokenizer, chosen, rank, world)[0])) for rank in range(world)]
    assert sum(shares, Counter()) == whole
    assert all(shares) and all(not (a & b) for i, a in enumerate(shares) for b in shares[i + 1:])
    sizes = [sum(share.values()) for share in shares]
    assert max(sizes) - min(sizes) <= 10  # balanced within a file / a record per rank


def test_val_size_holds_out_a_count_that_never_comes_back(folder, tokenizer) -> None:
    stream, evaluation = build_streams(tokenizer, settings(folder, "qa", val_size=6, buffer_size=8))
    assert evaluation is not None and len(evaluation) == 6
    held = set(rows_of(evaluation))
    for epoch in range(3):
        stream.set_epoch(epoch)
        trained = rows_of(stream)
        assert len(trained) == 34 and not held & set(trained)


def test_eval_dataset_is_read_into_memory(folder, tokenizer) -> None:
    stream, evaluation = build_streams(tokenizer, settings(folder, "qa", eval_dataset=("chat",)))
    mapped_eval = build_datasets(tokenizer, replace(settings(folder, "qa", eval_dataset=("chat",)),
                                                    streaming=False))[1]
    assert evaluation is not None and rows_of(evaluation) == rows_of(mapped_eval)


def test_interleaved_streams_follow_the_probabilities(folder, tokenizer) -> None:
    chosen = settings(folder, "qa", "chat", mix_strategy="interleave_under", interleave_probs=(0.5, 0.5))
    mapped, _ = build_datasets(tokenizer, replace(chosen, streaming=False))
    assert rows_of(build_streams(tokenizer, chosen)[0]) == rows_of(mapped)


def test_max_samples_keeps_the_first_records(folder, tokenizer) -> None:
    chosen = settings(folder, "qa", max_samples=7)
    assert rows_of(build_streams(tokenizer, chosen)[0]) == rows_of(build_datasets(tokenizer, replace(
        chosen, streaming=False))[0])


def test_a_bad_record_fails_when_the_stream_reaches_it(folder, tokenizer) -> None:
    stream, _ = build_streams(tokenizer, settings(folder, "broken"))
    with pytest.raises(DataError) as caught:
        list(stream)
    assert "broken.jsonl" in str(caught.value) and "record 4" in str(caught.value)  # numbered from 1


def test_what_a_stream_cannot_do_is_refused_with_the_reason(folder) -> None:
    fraction = check_data_settings(settings(folder, "qa", val_size=0.1))
    assert any("val_size (0.1)" in p and "streaming" in p for p in fraction)
    sampled = check_data_settings(settings(folder, "sampled"))
    assert any("num_samples (5)" in p and "'sampled'" in p for p in sampled)
    assert not check_data_settings(settings(folder, "qa", val_size=5))
    with pytest.raises(DataError):
        build_streams(build_test_tokenizer(), settings(folder, "qa", val_size=0.1))


BASE = {"model_name_or_path": "m", "output_dir": "o", "dataset": "qa", "streaming": True, "max_steps": 10}


@pytest.mark.parametrize("changes, expected", [
    ({"max_steps": -1}, "needs max_steps > 0"),
    ({"group_by_length": True}, "group_by_length (true) with streaming"),
    ({"tokenized_path": "tok"}, "tokenized_path (tok) with streaming"),
    ({"save_strategy": "epoch"}, "save_strategy (epoch) with streaming"),
    ({"eval_strategy": "epoch", "val_size": 4}, "eval_strategy (epoch) with streaming"),
])
def test_training_keys_that_need_a_length_are_refused(changes, expected) -> None:
    problems = cross_key_problems(build_config({**BASE, **changes}))
    assert [p for p in problems if expected in p], problems


def test_streaming_keys_reach_the_data_settings() -> None:
    chosen = data_settings(build_config({**BASE, "buffer_size": 128}))
    assert chosen.streaming and chosen.buffer_size == 128
    assert not cross_key_problems(build_config(BASE))


def test_streaming_without_max_steps_is_refused_before_work(folder, tmp_path) -> None:
    config = tmp_path / "stream.yaml"
    config.write_text(f"model_name_or_path: {tmp_path / 'tiny-model'}\nbuild_tiny_model_if_missing: true\n"
                      f"dataset: qa\ndataset_dir: {folder}\ntemplate: chatml\nstreaming: true\n"
                      f"output_dir: {tmp_path / 'out'}\n")
    result = run_cli("train", str(config))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "streaming (true) needs max_steps" in lines[0], lines
    assert not (tmp_path / "tiny-model").exists() and not (tmp_path / "out").exists()


def test_the_loop_reads_the_stream_again_and_fails_on_an_empty_share(folder, tokenizer) -> None:
    from torch.utils.data import DataLoader

    from shardtune.data import DataCollator
    from shardtune.train.setup import stream_passes

    stream, _ = build_streams(tokenizer, settings(folder, "qa", max_samples=3))
    batches = stream_passes(DataLoader(stream, batch_size=2, collate_fn=DataCollator(tokenizer.pad_token_id)))
    sizes = [len(next(batches)["input_ids"]) for _ in range(6)]
    assert sizes == [2, 1] * 3  # 3 samples per pass, passes follow each other
    empty, _ = build_streams(tokenizer, settings(folder, "qa", cutoff_len=3))  # no prompt fits
    with pytest.raises(DataError, match="share of the data holds no trainable sample"):
        next(stream_passes(DataLoader(empty, batch_size=2, collate_fn=DataCollator(tokenizer.pad_token_id))))
