"""Image + text sft and dpo on 2 processes against 1, with one rank given only text and the other only images.

The data holds image records (LLaMA-Factory's ``images`` column, ``<image>`` markers) and text records, placed so
that the sampler's shuffled order gives every image to rank 1 and every text to rank 0: rank 0's micro-batches
have no image, so it runs the vision tower on the blank image (data/images.py) while rank 1 runs it on real ones.
A rank that skipped the tower would hang ZeRO-3 and FSDP2 (their gathers inside it) or break DDP with a trainable
tower. One process sees the same global batches, mixed. Per cell: the same per-step losses, and the saved folder
loads in transformers as the download's image-text class, with the 1-process run's logits on an image prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.helpers import ENGINE_KEYS, losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SEED, RECORDS = 42, 16  # the config's seed (examples/tiny/sft_full.yaml) and the number of records
COLOURS = {"red": (255, 0, 0), "blue": (0, 0, 255), "green": (0, 160, 0), "yellow": (255, 220, 0)}
IMAGE_KEYS = ("dataset=split_demo", "cutoff_len=160")  # a tiny Gemma 4 image is 64 soft tokens
TOWER = ("freeze_vision_tower=false", "freeze_multi_modal_projector=false")
DPO = ("stage=dpo", "pref_beta=0.1")
QWEN, GEMMA, GEMMA4 = "qwen3_vl", "gemma3", "gemma4"
# The tiny Gemma 4 trains at 1e-4 in full (at 1e-3 it is chaotic: tests/distributed/test_registry_engines.py).
SLOW = ("learning_rate=1e-4",)
CELLS = [(QWEN, "ddp", "lora", ()), (QWEN, "zero3", "full", ()), (QWEN, "fsdp2", "full", ()),
         (QWEN, "ddp", "full", TOWER), (QWEN, "zero3", "full", TOWER), (QWEN, "ddp", "lora", DPO),
         (QWEN, "zero3", "full", DPO), (QWEN, "fsdp2", "full", DPO),
         (GEMMA, "ddp", "lora", ()), (GEMMA, "zero3", "full", ()), (GEMMA, "fsdp2", "full", TOWER),
         (GEMMA4, "ddp", "lora", ()), (GEMMA4, "zero3", "full", SLOW), (GEMMA4, "fsdp2", "full", SLOW)]
SLICE = {(QWEN, "ddp", "lora", ()), (QWEN, "fsdp2", "full", DPO)}  # make test; the rest in make test-matrix
TEMPLATES = {QWEN: "qwen3_nothink", GEMMA: "gemma3", GEMMA4: "gemma4"}


def cell_id(family: str, engine: str, finetuning: str, keys: tuple[str, ...]) -> str:
    return f"{family}-{engine}-{finetuning}" + {TOWER: "-tower", DPO: "-dpo"}.get(keys, "")


def rank_split_data(folder: Path, pairs: bool = False) -> Path:
    """A dataset folder whose records the sampler deals out as: rank 0 text only, rank 1 images only (``pairs``:
    dpo pairs, a chosen and a rejected answer to each prompt)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    for number, (name, colour) in enumerate(COLOURS.items()):
        Image.new("RGB", (32 + 16 * number, 32), colour).save(folder / "images" / f"{name}.png")
    order = torch.randperm(RECORDS, generator=torch.Generator().manual_seed(SEED)).tolist()
    image_slots = set(order[1::2])  # DistributedSampler: rank r takes the shuffled order's r-th of every 2
    names = list(COLOURS)
    records = []
    for index in range(RECORDS):
        name, other = names[index % len(names)], names[(index + 1) % len(names)]
        if index in image_slots:
            prompt, answer, wrong = "<image>What colour is this?", f"It is {name}.", f"It is {other}."
        else:
            prompt, answer, wrong = f"Name a colour like {name}.", f"{name.title()} is one.", "No."
        record: dict = {"messages": [{"role": "user", "content": prompt}]}
        if pairs:
            record.update(chosen={"role": "assistant", "content": answer},
                          rejected={"role": "assistant", "content": wrong})
        else:
            record["messages"].append({"role": "assistant", "content": answer})
        if index in image_slots:
            record["images"] = [f"images/{name}.png"]
        records.append(record)
    (folder / "split.json").write_text(json.dumps(records), encoding="utf-8")
    columns = {"messages": "messages", "images": "images",
               **({"chosen": "chosen", "rejected": "rejected"} if pairs else {})}
    info = {"split_demo": {"file_name": "split.json", "formatting": "sharegpt", "ranking": pairs,
                           "columns": columns, "tags": {"role_tag": "role", "content_tag": "content",
                                                        "user_tag": "user", "assistant_tag": "assistant"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    return folder


# "image_family", not "family": scripts/architecture_table.py reads "family" cells as the text model's.
@pytest.mark.parametrize(("image_family", "engine", "finetuning", "keys"), [
    pytest.param(*cell, id=cell_id(*cell), marks=() if cell in SLICE else pytest.mark.matrix) for cell in CELLS])
def test_images_on_one_rank_text_on_the_other_match_one_process(image_family, engine, finetuning, keys,
                                                                arch_model_dir, tmp_path):
    image_model = arch_model_dir(f"image-text:{image_family}")
    data = rank_split_data(tmp_path / "data", pairs=keys == DPO)
    common = (*IMAGE_KEYS, f"template={TEMPLATES[image_family]}", f"dataset_dir={data}", *keys)
    one, two = tmp_path / "one", tmp_path / "two"
    train(image_model, one, finetuning, 1, 4, *common)
    results = train(image_model, two, finetuning, 2, 2, *common, *ENGINE_KEYS[engine])
    assert results["world_size"] == 2
    assert losses(two) == pytest.approx(losses(one), rel=2e-3)
    trained_two, trained_one = reloaded(two, image_model, finetuning), reloaded(one, image_model, finetuning)
    base_class = type(trained_two.get_base_model() if finetuning == "lora" else trained_two).__name__
    assert base_class == json.loads((image_model / "config.json").read_text())["architectures"][0]
    torch.testing.assert_close(image_logits(trained_two, image_model, data),
                               image_logits(trained_one, image_model, data), rtol=1e-3, atol=2e-3)
    assert (two / "preprocessor_config.json").is_file()  # the saved folder reads images as the download does


def reloaded(out: Path, base: Path, finetuning: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    if finetuning == "lora":
        from peft import PeftModel

        return PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), out).eval()
    return AutoModelForImageTextToText.from_pretrained(out).eval()


def image_logits(model: torch.nn.Module, base: Path, data: Path) -> torch.Tensor:
    """The model's logits on one image prompt, its inputs built by shardtune's image processor."""
    from transformers import AutoTokenizer

    from shardtune.data.images import ImageSettings, load_image_processor

    processor = load_image_processor(str(base), AutoTokenizer.from_pretrained(base), ImageSettings())
    ids = processor.encode_piece("<|im_start|>user\n<image>What colour is this?<|im_end|>\n",
                                 [str(data / "images" / "red.png")])
    input_ids = torch.tensor([ids])
    pixels = processor.pixel_inputs([str(data / "images" / "red.png")])
    with torch.no_grad():
        return model(input_ids=input_ids, **{processor.layout.type_key: processor.type_ids(input_ids)},
                     **pixels).logits
