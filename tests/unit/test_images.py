"""Images in sft data (data/images.py): records, tokens, batches, and one training step per family.

Tiny image-text models come from their config classes (model/tiny.py) with the family's image processor saved
beside them; images are synthetic PNGs written here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtune.data import build_datasets
from shardtune.data.collator import DataCollator
from shardtune.data.images import ImageSettings, VisionCollator, load_image_processor
from shardtune.data.settings import IGNORE_INDEX, DataSettings
from shardtune.errors import DataError
from shardtune.model.composite import model_parts

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "gemma4"]
CHAT_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}


@pytest.fixture(scope="module")
def image_model(arch_model_dir) -> Path:
    return arch_model_dir("image-text:qwen3_vl")


def write_data(folder: Path, records: list[dict], images: dict[str, tuple[int, int]]) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for name, size in images.items():
        Image.new("RGB", size, (200, 30, 30)).save(folder / name)
    (folder / "chats.json").write_text(json.dumps(records), encoding="utf-8")
    info = {"chats": {"file_name": "chats.json", "formatting": "sharegpt", "tags": CHAT_TAGS,
                      "columns": {"messages": "messages", "images": "images"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    return folder


def chat(question: str, answer: str, images: list[str] | None = None) -> dict:
    record: dict = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    if images is not None:
        record["images"] = images
    return record


def settings(data: Path, model: Path, **extra) -> DataSettings:
    return DataSettings(**{"dataset": ("chats",), "dataset_dir": str(data), "template": "qwen3_nothink",
                           "cutoff_len": 256, "model_dir": str(model), **extra})


def tokenizer_of(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def test_each_image_becomes_one_token_per_merged_patch_between_its_markers(image_model, tmp_path):
    data = write_data(tmp_path / "data", [chat("<image>What is this?", "A square.", ["a.png"]),
                                          chat("No image here.", "Fine.")], {"a.png": (64, 32)})
    tokenizer = tokenizer_of(image_model)
    train, _ = build_datasets(tokenizer, settings(data, image_model))
    processor = load_image_processor(str(image_model), tokenizer, ImageSettings())
    grid = processor.pixel_inputs([str(data / "a.png")])["image_grid_thw"][0]
    merged = int(grid.prod()) // processor.image_processor.merge_size ** 2
    ids, labels = train[0]["input_ids"], train[0]["labels"]
    assert ids.count(processor.image_token_id) == merged > 1
    start = ids.index(processor.before[-1])
    assert ids[start + 1 + merged] == processor.after[0]  # the image's tokens are one run between its markers
    assert all(label == IGNORE_INDEX for label, token in zip(labels, ids, strict=True)
               if token == processor.image_token_id)
    assert train[0]["images"] == [str(data / "a.png")] and train[1]["images"] == []


@pytest.mark.parametrize(("record", "problem"), [
    (chat("What is this?", "A square.", ["a.png"]), "0 '<image>' markers for 1 images"),
    (chat("<image>What is this?", "A square.", ["missing.png"]), "missing.png does not exist"),
    (chat("<image>What is this?", "<image>", ["a.png"]), "in an answer"),
])
def test_a_record_whose_images_do_not_fit_is_named_with_its_line(image_model, tmp_path, record, problem):
    data = write_data(tmp_path / "data", [chat("Hi", "Hello"), record], {"a.png": (32, 32)})
    with pytest.raises(DataError, match=rf"chats.json record 2 \(line \d+\): .*{problem}"):
        build_datasets(tokenizer_of(image_model), settings(data, image_model))


def test_a_text_model_given_images_is_refused_by_name(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data", [chat("<image>What is this?", "A square.", ["a.png"])], {"a.png": (32, 32)})
    with pytest.raises(DataError, match="model type 'llama' has no image processor in transformers"):
        build_datasets(tokenizer_of(tiny_model_dir), settings(data, tiny_model_dir))


def test_packing_with_images_is_refused(image_model, tmp_path):
    data = write_data(tmp_path / "data", [chat("<image>What is this?", "A square.", ["a.png"])], {"a.png": (32, 32)})
    with pytest.raises(DataError, match="packing \\(true\\) with images"):
        build_datasets(tokenizer_of(image_model), settings(data, image_model, packing=True))


def test_images_in_reward_model_pairs_are_refused_by_dataset(image_model, tmp_path):
    data = write_data(tmp_path / "data", [], {"a.png": (32, 32)})
    pair = {"conversations": [{"from": "human", "value": "<image>Describe it."}], "chosen": {"from": "gpt",
            "value": "A square."}, "rejected": {"from": "gpt", "value": "A circle."}, "images": ["a.png"]}
    (data / "chats.json").write_text(json.dumps([pair]), encoding="utf-8")
    info = {"chats": {"file_name": "chats.json", "formatting": "sharegpt", "ranking": True,
                      "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                                  "images": "images"}}}
    (data / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    with pytest.raises(DataError, match=r"dataset .chats. has images \(columns.images\): images in rm data"):
        build_datasets(tokenizer_of(image_model), settings(data, image_model, stage="rm"))


def test_turns_cut_by_cutoff_len_take_their_images_with_them(image_model, tmp_path):
    long_answer = " ".join(["word"] * 60)
    record = {"messages": [{"role": "user", "content": "<image>First?"}, {"role": "assistant", "content": "One."},
                           {"role": "user", "content": "<image>Second?"},
                           {"role": "assistant", "content": long_answer}], "images": ["a.png", "b.png"]}
    data = write_data(tmp_path / "data", [record], {"a.png": (32, 32), "b.png": (64, 64)})
    tokenizer = tokenizer_of(image_model)
    kept, _ = build_datasets(tokenizer, settings(data, image_model, cutoff_len=40))
    assert kept[0]["images"] == [str(data / "a.png")]  # the second turn's prompt did not fit: its image is gone
    last, _ = build_datasets(tokenizer, settings(data, image_model, cutoff_len=200, mask_history=True))
    assert last[0]["images"] == [str(data / "a.png"), str(data / "b.png")]


def test_a_batch_without_images_runs_the_tower_without_changing_any_trained_token(image_model, tmp_path):
    """The blank image's tokens sit after every real token with no label: logits of real tokens are unchanged."""
    from transformers import AutoModelForImageTextToText

    data = write_data(tmp_path / "data", [chat("Plain text only.", "Yes."), chat("More text.", "Sure."),
                                          chat("<image>And this?", "An image.", ["a.png"])], {"a.png": (32, 32)})
    tokenizer = tokenizer_of(image_model)
    train, _ = build_datasets(tokenizer, settings(data, image_model))
    train = train.select([0, 1])  # the text-only rows of a run with images
    processor = load_image_processor(str(image_model), tokenizer, ImageSettings())
    text_collator = DataCollator(tokenizer.pad_token_id, attn_implementation="sdpa")
    plain = text_collator([dict(row) for row in train.remove_columns("images")])
    batch = VisionCollator(text_collator, processor)([dict(row) for row in train])
    assert "position_ids" not in batch and batch["image_grid_thw"].shape == (1, 3)
    assert int(batch["mm_token_type_ids"].sum()) == int((batch["input_ids"] == processor.image_token_id).sum()) > 0
    assert processor.before and processor.after  # vision_start / vision_end around the blank image's tokens
    assert bool((batch["labels"][batch["input_ids"] == processor.image_token_id] == IGNORE_INDEX).all())
    model = AutoModelForImageTextToText.from_pretrained(image_model).eval()
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_tokens")}
    with torch.no_grad():
        with_blank = model(**inputs).logits
        without = model(input_ids=plain["input_ids"], attention_mask=plain.get("attention_mask")).logits
    for row in range(len(train)):
        real = (plain["labels"][row] != IGNORE_INDEX) | (plain["input_ids"][row] != tokenizer.pad_token_id)
        length = int(real.sum())
        torch.testing.assert_close(with_blank[row, :length], without[row, :length], rtol=1e-4, atol=1e-5)


def test_images_under_sequence_parallelism_are_refused_on_the_rank(image_model):
    """A split batch needs the whole row's positions, sliced (train/sequence_shards.py); the image collator leaves
    positions to the model (mRoPE, from the whole row's image grids), and a slice's image tokens would not match the
    tower's features of every image: the first split micro-batch failed with KeyError 'position_ids'. Refused with
    the key instead (shardtune check refuses it before launch: engines/sequence_parallel_plan.py)."""
    tokenizer = tokenizer_of(image_model)
    processor = load_image_processor(str(image_model), tokenizer, ImageSettings())
    with pytest.raises(DataError, match=r"sequence_parallel_size \(2\)"):
        VisionCollator(DataCollator(tokenizer.pad_token_id, sequence_parallel=2), processor)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_a_step_on_an_image_batch(family, arch_model_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    model_dir = arch_model_dir(f"image-text:{family}")
    data = write_data(tmp_path / "data", [chat("<image>What colour?", "Red.", ["a.png"]),
                                          chat("Two: <image> and <image>?", "Both red.", ["a.png", "b.png"])],
                      {"a.png": (32, 48), "b.png": (64, 64)})
    tokenizer = tokenizer_of(model_dir)
    train, _ = build_datasets(tokenizer, settings(data, model_dir))
    processor = load_image_processor(str(model_dir), tokenizer, ImageSettings())
    batch = VisionCollator(DataCollator(tokenizer.pad_token_id, attn_implementation="sdpa"), processor)(
        [dict(row) for row in train])
    images = batch["image_grid_thw"].shape[0] if "image_grid_thw" in batch else batch["pixel_values"].shape[0]
    assert images == 3
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    loss = model(**{k: v for k, v in batch.items() if k != "num_tokens"}).loss
    loss.backward()
    parts = model_parts(model)
    assert parts is not None
    # The images reach the loss: the tower's or the projector's weights get a gradient (a tiny Gemma 3's projection
    # starts at zero, so its tower's gradient is zero until the projection moves).
    image_parts = [p.grad for name, p in model.named_parameters() if parts.part_of(name) != "language"]
    assert torch.isfinite(loss) and sum(float(grad.abs().sum()) for grad in image_parts if grad is not None) > 0


def test_a_pair_puts_its_images_in_both_rows_and_rows_take_their_own_pixels(image_model, tmp_path):
    from shardtune.data.collator import PairCollator
    from shardtune.data.images import image_inputs_of_rows

    data = write_data(tmp_path / "data", [], {"a.png": (32, 32), "b.png": (64, 64)})
    pairs = [{"messages": [{"role": "user", "content": question}], "images": images,
              "chosen": {"role": "assistant", "content": "Yes."}, "rejected": {"role": "assistant", "content": "No."}}
             for question, images in (("<image>Red?", ["a.png"]), ("Plain?", []),
                                      ("<image><image>Both?", ["a.png", "b.png"]))]
    (data / "chats.json").write_text(json.dumps(pairs), encoding="utf-8")
    info = {"chats": {"file_name": "chats.json", "formatting": "sharegpt", "ranking": True, "tags": CHAT_TAGS,
                      "columns": {"messages": "messages", "chosen": "chosen", "rejected": "rejected",
                                  "images": "images"}}}
    (data / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    tokenizer = tokenizer_of(image_model)
    train, _ = build_datasets(tokenizer, settings(data, image_model, stage="dpo"))
    processor = load_image_processor(str(image_model), tokenizer, ImageSettings())
    batch = PairCollator(VisionCollator(DataCollator(tokenizer.pad_token_id), processor))([dict(r) for r in train])
    assert batch["image_grid_thw"].shape[0] == 6  # 3 images, each in the chosen and the rejected row
    for side in (0, 3):  # the chosen rows, then the rejected rows
        own = image_inputs_of_rows(batch, side, side + 3)
        torch.testing.assert_close(own["image_grid_thw"], processor.pixel_inputs(
            [str(data / name) for name in ("a.png", "a.png", "b.png")])["image_grid_thw"])
    last = image_inputs_of_rows(batch, 5, 6)
    assert last["pixel_values"].shape[0] == int(last["image_grid_thw"].prod(dim=-1).sum()) > 0


def test_the_ddp_probe_with_an_image_keeps_the_tower_and_finds_what_no_image_reaches(image_model):
    """DDP freezes what the loss never reaches (model/gradient_probe.py); with images in the data its probe feeds
    the blank image, so the tower stays trainable and only the parts no input reaches are found (a tiny Qwen3-VL's
    deepstack mergers read tower layers 8, 16 and 24 of its 2)."""
    from transformers import AutoModelForImageTextToText

    from shardtune.data.images import blank_image_inputs
    from shardtune.model.gradient_probe import parameters_without_gradient

    model = AutoModelForImageTextToText.from_pretrained(image_model)
    unreached = parameters_without_gradient(model, torch.device("cpu"), blank_image_inputs(str(image_model)))
    assert unreached and all(".deepstack_merger_list." in name for name in unreached)
    text_only = parameters_without_gradient(model, torch.device("cpu"))
    assert any(".patch_embed." in name for name in text_only)
