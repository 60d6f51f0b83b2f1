"""LLaMA-Factory's example files as our fixtures: the manifest of verdicts, and a file made ready to run here.

``tests/fixtures/llamafactory_examples/`` holds, for every training file of LLaMA-Factory's ``examples/`` folder, a
file of ours at the same relative path with the same keys and values; only the model, data and output paths are
placeholders (``MODEL``, ``OUTPUT``, ``DATA_DIR`` below). ``manifest.yaml`` gives each example file (training or
not) its verdict: ``runs``, ``refused: <what the first error line says>``, ``needs a GPU: <what check says on a
CPU-only machine>``, ``runs on a GPU: <why it trains only there>`` (check passes anywhere), ``runs on one process:
<why not on more>`` (check passes; trained on one process, as LLaMA-Factory allows it) or ``not training: <what it
is>``.
The files are run from a work folder that holds ``data/`` (our data in LLaMA-Factory's layout) and ``examples/``
(shardtune's DeepSpeed configs under LLaMA-Factory's names), since LLaMA-Factory resolves those from the cwd.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "llamafactory_examples"
MANIFEST = FIXTURES / "manifest.yaml"
MODEL, OUTPUT, DATA_DIR = "__MODEL__", "__OUTPUT__", "__DATA_DIR__"
# A file written for a LLaMA-Pro expanded model (its freeze_trainable_layers is the number of blocks added): the tiny
# model at 8 layers, expanded by 8 blocks with `shardtune expand-model`, built once under the model's folder.
LLAMA_PRO_MODEL, LLAMA_PRO_BLOCKS = "__LLAMA_PRO_MODEL__", 8
# A file written for OFT with oft_block_size 32, which must divide each adapted layer's in_features (a real model's
# widths are multiples of 32; the tiny model's MLP, 172 wide, is not): the tiny model with a 192-wide MLP.
OFT_MODEL, OFT_MLP_WIDTH = "__OFT_MODEL__", 192
# A file for an image-text model: ``__IMAGE_TEXT_MODEL_<model type>__`` is that family's tiny image-text folder
# (with its image processor), built once beside the tiny model.
IMAGE_TEXT_MODEL = re.compile(r"__IMAGE_TEXT_MODEL_(\w+?)__")
# A file that splits a mixture-of-experts model's experts over ep_size ranks (v1's FSDPTurbo, ep_size 16): the tiny
# Qwen3-MoE with MOE_EXPERTS experts per layer, so that ep_size divides them.
MOE_MODEL, MOE_EXPERTS = "__MOE_MODEL__", 16
RUNS, REFUSED, NOT_TRAINING = "runs", "refused: ", "not training: "
NEEDS_GPU, RUNS_ON_GPU = "needs a GPU: ", "runs on a GPU: "
RUNS_ONE_PROCESS = "runs on one process: "


def load_manifest() -> dict[str, str]:
    """Example path (relative to LLaMA-Factory's examples/) -> verdict."""
    return yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))["files"]


def training_files(manifest: dict[str, str]) -> list[str]:
    return [path for path, verdict in manifest.items() if not verdict.startswith(NOT_TRAINING)]


def make_work_folder(work: Path) -> Path:
    """A folder laid out as LLaMA-Factory's repository root is: data/ and examples/ beside the config files;
    examples/deepspeed/ holds shardtune's presets and, from ``FIXTURES / "deepspeed"``, our copies of the
    LLaMA-Factory DeepSpeed files that have no preset (ds_z3_fp8_config.json)."""
    links = {work / "data": FIXTURES / "data"}
    links.update({work / "examples" / child.name: child for child in (REPO / "examples").iterdir()
                  if child.name != "deepspeed"})
    for config in [*(REPO / "examples" / "deepspeed").glob("*.json"), *(FIXTURES / "deepspeed").glob("*.json")]:
        links[work / "examples" / "deepspeed" / config.name] = config
    for link, target in links.items():
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(target, target_is_directory=target.is_dir())
    return work


def filled_in(relative: str, work: Path, model: Path, output: Path) -> Path:
    """The fixture mirroring ``relative``, its placeholders replaced, written under ``work`` (same relative path)."""
    text = (FIXTURES / relative).read_text(encoding="utf-8")
    if LLAMA_PRO_MODEL in text:
        text = text.replace(LLAMA_PRO_MODEL, str(llama_pro_model(model.parent / "llama-pro-expanded")))
    if OFT_MODEL in text:
        text = text.replace(OFT_MODEL, str(oft_model(model.parent / "tiny-llama-mlp-192")))
    if MOE_MODEL in text:
        text = text.replace(MOE_MODEL, str(moe_model(model.parent / f"tiny-qwen3-moe-{MOE_EXPERTS}")))
    text = IMAGE_TEXT_MODEL.sub(lambda found: str(image_text_model(model.parent, found.group(1))), text)
    text = text.replace(MODEL, str(model)).replace(OUTPUT, str(output)).replace(DATA_DIR, str(work / "data"))
    path = work / "configs" / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def llama_pro_model(folder: Path) -> Path:
    """The tiny model at 8 layers expanded by ``LLAMA_PRO_BLOCKS`` blocks (written once)."""
    if not (folder / "config.json").is_file():
        from shardtune.model.llama_pro import expand_model
        from shardtune.model.tiny import build_tiny_model

        base = build_tiny_model(folder.with_name(folder.name + "-base"), layers=LLAMA_PRO_BLOCKS)
        expand_model(str(base), str(folder), LLAMA_PRO_BLOCKS)
    return folder


def moe_model(folder: Path) -> Path:
    """The tiny Qwen3-MoE with ``MOE_EXPERTS`` experts per layer (written once): its config with the expert count
    raised, random weights, the tiny family's tokenizer."""
    if not (folder / "config.json").is_file():
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from shardtune.model.tiny import build_tiny_model

        base = build_tiny_model(folder.with_name(folder.name + "-base"), arch="qwen3_moe")
        config = AutoConfig.from_pretrained(base)
        config.num_experts = MOE_EXPERTS
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def expert_parallel_ranks(config: dict) -> int:
    """The ranks a file's experts are split over (v1's dist_config.ep_size), 1 when it does not split them."""
    dist = config.get("dist_config")
    return int(dist.get("ep_size") or 1) if isinstance(dist, dict) else 1


def oft_model(folder: Path) -> Path:
    """The tiny model with an MLP ``OFT_MLP_WIDTH`` wide (written once)."""
    if not (folder / "config.json").is_file():
        from shardtune.model.tiny import build_tiny_model

        build_tiny_model(folder, intermediate=OFT_MLP_WIDTH)
    return folder


def image_text_model(parent: Path, model_type: str) -> Path:
    """The tiny image-text model of ``model_type`` (written once)."""
    folder = parent / f"tiny-image-text-{model_type}"
    if not (folder / "config.json").is_file():
        from shardtune.model.tiny import build_tiny_model

        build_tiny_model(folder, arch=model_type, image_text=True)
    return folder


def first_error(stderr: str) -> str:
    """The first ``shardtune: error:`` line, without that prefix ('' when there is none)."""
    prefix = "shardtune: error: "
    return next((line[len(prefix):] for line in stderr.splitlines() if line.startswith(prefix)), "")
