"""Build a tiny random model (LLaMA by default, any family in model/architectures.py) and a locally trained
tokenizer: demos and tests need no model hub."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from shardtune.paths import reads_as_hub_id

DEMO_MODELS = "models"  # the demo's folder of models (examples/tiny: models/tiny-llama); `make clean` removes it


def tiny_model_build_problem(name: str) -> str | None:
    """Why ``build_tiny_model_if_missing`` must not build at ``name`` (None: it may). It builds only the demo's own
    kind of folder: a missing local folder whose name says it holds a tiny model. Never at a hub id (a copied demo
    file pointed at a real model would train random weights instead) nor at a real model's path (a typo, a
    filesystem not mounted), nor into a folder that exists."""
    path = Path(name)
    if path.exists():
        return None if (path / "config.json").is_file() else (
            f"build_tiny_model_if_missing: {name} exists; a tiny model is built only in a new folder: fix "
            "model_name_or_path, or remove build_tiny_model_if_missing to read the folder as a model")
    if reads_as_hub_id(name) and path.parts[0] != DEMO_MODELS:
        return (f"build_tiny_model_if_missing: model_name_or_path {name} reads as a hub id, and a random tiny model "
                f"is built only in a local folder: remove build_tiny_model_if_missing to load {name}, or write "
                f"./{name} to build the demo model there")
    if "tiny" not in path.name.lower():
        return (f"build_tiny_model_if_missing: {name} does not exist, and a random tiny model is built only in a "
                "folder whose name says so (contains 'tiny', as models/tiny-llama): fix model_name_or_path, or "
                "name the new folder after the demo model")
    return None


SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
# chatml, so that `template: auto` has a chat template to use.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bundled_corpus() -> Iterator[str]:
    """Lines of the text shipped with the package for training the tiny tokenizer."""
    text = resources.files("shardtune.model").joinpath("tiny_corpus.txt").read_text(encoding="utf-8")
    yield from (line for line in text.splitlines() if line.strip())


def build_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 2048, extra_special: Iterable[str] = ()):
    """A byte-level BPE trained on ``texts``, with LLaMA-3 and chatml special tokens (and ``extra_special``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([*SPECIAL_TOKENS, *extra_special]))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
        additional_special_tokens=specials[3:],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 172,
    vocab_size: int = 2048,
    max_positions: int = 2048,
    seed: int = 0,
    from_registry: bool = False,
    image_text: bool = False,
) -> Path:
    """Write a random-weight model of family ``arch`` and its tokenizer to ``out_dir`` (safetensors): a family of
    model/architectures.py with its chat template and special tokens at the sizes given, or (``from_registry``, or
    a model type not listed there) the class transformers' causal-LM registry builds for the model type ``arch``,
    at model/registry.py's tiny sizes, with chatml (``gemma3`` there is the image-text model); ``image_text``: the
    image-text class of transformers' image-text registry, with its vision tower, as such checkpoints are
    downloaded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from shardtune.data.templates import get_template
    from shardtune.data.templates.jinja import chat_template_jinja
    from shardtune.model.architectures import FAMILIES, family, tiny_config
    from shardtune.model.registry import special_token_ids, tiny_image_text_config, tiny_registry_config
    from shardtune.model.saved import without_deepspeed_lookup

    out = Path(out_dir)
    if image_text:
        tokens = vision_tokens(arch)
        tokenizer = build_tiny_tokenizer(bundled_corpus(), vocab_size=vocab_size, extra_special=tokens.values())
        config = tiny_image_text_config(arch, len(tokenizer), special_token_ids(tokenizer))
        for field, token in tokens.items():
            setattr(config, field, tokenizer.convert_tokens_to_ids(token))
        if tokens and type(getattr(config, "mm_tokens_per_image", None)) is int:
            config.mm_tokens_per_image = TINY_IMAGE_TOKENS  # Gemma 3: a square, pooled from the tower's patches
    elif arch in FAMILIES and not from_registry:
        template = get_template(family(arch).template)
        tokenizer = build_tiny_tokenizer(bundled_corpus(), vocab_size=vocab_size,
                                         extra_special=sorted(template.literal_special_tokens()))
        if arch != "llama":  # the llama default keeps chatml, which `make demo` and most tests render
            tokenizer.chat_template = chat_template_jinja(template, tokenizer)
        config = tiny_config(arch, tokenizer=tokenizer, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                             intermediate=intermediate, max_positions=max_positions)
    else:  # any other family of transformers' registry: its own config at the registry's tiny sizes, chatml
        tokenizer = build_tiny_tokenizer(bundled_corpus(), vocab_size=vocab_size)
        config = tiny_registry_config(arch, len(tokenizer), special_token_ids(tokenizer))
    # Its own random stream: a run that builds its demo model first (build_tiny_model_if_missing, main rank only)
    # must draw the same LoRA initialisation and dropout as every later run of the same config.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (AutoModelForImageTextToText if image_text else AutoModelForCausalLM).from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    with without_deepspeed_lookup():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if image_text and vision_tokens(arch):
        save_tiny_processor(out, config)
    return out


TINY_IMAGE_TOKENS = 16  # soft tokens per image of a tiny Gemma 3 (256 in the real ones)


def vision_tokens(model_type: str) -> dict[str, str]:
    """The config's image token fields and their tokens, for a family whose images shardtune reads ({} otherwise)."""
    from shardtune.data.images import layout_of

    layout = layout_of(model_type)
    return dict(layout.tokens) if layout is not None else {}


def save_tiny_processor(out: Path, config: Any) -> None:
    """The family's image processor for the tiny tower (its patch sizes) with small default image bounds, saved as
    checkpoints keep it (preprocessor_config.json beside the weights)."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    from shardtune.data.images import processor_class_name

    # A family without its own entry (Qwen3-VL-MoE) uses the image processor of one with the same processor class.
    processor = processor_class_name(config.model_type)
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(config.model_type) or next(
        names for model_type, names in IMAGE_PROCESSOR_MAPPING_NAMES.items()
        if names and processor_class_name(model_type) == processor)
    vision = config.vision_config
    image_class = getattr(transformers, names["pil"])
    if hasattr(vision, "spatial_merge_size"):  # Qwen: images scaled by their pixels into patch grids
        image_processor = image_class(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                      temporal_patch_size=vision.temporal_patch_size,
                                      size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64})
    elif hasattr(vision, "pooling_kernel_size"):  # Gemma 4: patches for its smallest soft-token budget
        image_processor = image_class(patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size,
                                      max_soft_tokens=70)
    else:  # Gemma 3: every image resized to the tower's one input size
        image_processor = image_class(size={"height": vision.image_size, "width": vision.image_size})
    image_processor.save_pretrained(out)
