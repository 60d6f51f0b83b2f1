"""Shared helpers for the data-layer tests (imported by tests/unit/test_data_*.py).

The tokenizer is a small byte-level BPE trained on the bundled demo data, with the special tokens
the templates use, so that tests need no downloads. It is cached per process because several test
modules build it (each defines a module fixture calling ``build_test_tokenizer``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from shardtune.data import DataSettings
from shardtune.data.settings import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = REPO / "data"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_JINJA = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def demo_texts() -> Iterator[str]:
    """Every string in the bundled demo files: the tokenizer's training corpus."""
    for record in json.loads((DATA_DIR / "demo_alpaca.json").read_text(encoding="utf-8")):
        yield from (v for v in record.values() if isinstance(v, str))
    for line in (DATA_DIR / "demo_sharegpt.jsonl").read_text(encoding="utf-8").splitlines():
        yield from (turn["value"] for turn in json.loads(line)["conversations"])
    for line in (DATA_DIR / "demo_pt.jsonl").read_text(encoding="utf-8").splitlines():
        yield json.loads(line)["text"]


@functools.lru_cache(maxsize=1)
def build_test_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (vocab 1000) with a chatml ``chat_template``; built once per process."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(demo_texts(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|pad|>",
        extra_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = CHATML_JINJA
    return tokenizer


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def expected_ids_and_labels(tokenizer: Any, pieces: list[str]) -> tuple[list[int], list[int]]:
    """Alternating (prompt, response) pieces encoded one by one: prompts masked, responses trained."""
    ids: list[int] = []
    labels: list[int] = []
    for index, piece in enumerate(pieces):
        encoded = encode(tokenizer, piece)
        ids += encoded
        labels += encoded if index % 2 else [IGNORE_INDEX] * len(encoded)
    return ids, labels


def write_registry(directory: Path, entries: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "dataset_info.json").write_text(json.dumps(entries, indent=2), encoding="utf-8")
    return directory


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def alpaca_dir(tmp_path: Path, records: list[dict[str, Any]], **entry: Any) -> Path:
    """A dataset_dir holding one alpaca JSON-lines dataset named 'toy'."""
    write_jsonl(tmp_path / "toy.jsonl", records)
    return write_registry(tmp_path, {"toy": {"file_name": "toy.jsonl", "formatting": "alpaca", **entry}})


def settings_for(dataset_dir: Path, *names: str, **overrides: Any) -> DataSettings:
    return DataSettings(dataset=names or ("toy",), dataset_dir=str(dataset_dir), **overrides)


def valid_labels(labels: list[int]) -> list[int]:
    return [label for label in labels if label != -100]
