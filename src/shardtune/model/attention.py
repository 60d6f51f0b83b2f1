"""Which attention kernel a model trains with, and which masks its layers need for packed rows.

Decided on the launching host from the model's config.json (its ``model_type``, else ``architectures``), before
any weights load: the model class says which kernels it supports (``_supports_flash_attn``, ``_supports_sdpa``;
every class runs ``eager``). ``auto`` takes the fastest supported one: flash_attention_2 when the flash-attn
package and a CUDA GPU are present; else, for rows packed with sample boundaries on a CUDA GPU in bf16/fp16,
``varlen`` (torch's own varlen flash kernel: model/varlen.py) where the class passes the offsets on; else sdpa,
else eager. An explicit kernel the class does not support is refused with the key, the model and the fix, instead
of failing inside every rank.

Packed rows (see data/collator.py) need one block-diagonal mask per kind of attention layer: sliding-window
layers get the window on top of the sample boundaries. ``layer_windows`` reads those kinds from the config.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune import versions
from shardtune.data.settings import VARLEN, takes_offsets
from shardtune.errors import ModelError
from shardtune.model.composite import image_text_class_name
from shardtune.model.folder import model_config_json
from shardtune.model.transformers_tables import causal_lm_class_name, class_attributes, find_class_file

AUTO = "auto"
KERNELS = ("flash_attention_2", VARLEN, "sdpa", "eager")
FULL, SLIDING = "full_attention", "sliding_attention"
FLASH_ATTN_SPELLING = {"flash_attention_2": "fa2", "sdpa": "sdpa", "eager": "disabled"}  # LLaMA-Factory's key


@dataclass(frozen=True)
class AttentionChoice:
    kernel: str
    reason: str


@dataclass(frozen=True)
class KernelSupport:
    """What a model class can run, found from the class itself."""

    model_class: str
    flash: bool
    sdpa: bool
    sinks: bool  # learnable attention sinks, which transformers passes only to kernels that take them
    mask_per_layer_type: bool  # forward accepts {layer type: mask} (models mixing local and global layers)
    # forward takes a 4-D mask as given (transformers' masking_utils); False: it builds its own from a 2-D padding
    # mask (GPT-1, XLNet, ProphetNet, CPM-Ant), or reads positions from one (BLOOM's ALiBi)
    prepared_mask: bool = True
    # its attention modules call the kernel registered under the config's name, the forward's kwargs passed on
    # (transformers' ``_supports_attention_backend``): what a kernel of shardtune's own needs
    attention_interface: bool = False
    softcap: bool = False  # attention logit softcapping (Gemma 2), which only eager and flash-attn compute
    attention_dropout: bool = False  # the config drops attention probabilities in training
    image_text: bool = False  # an image-text class: its vision tower attends under the same kernel
    bidirectional: bool = False  # an encoder family's config not set as a decoder (is_decoder: false)


def kernel_support(config: Mapping[str, Any]) -> KernelSupport | None:
    """The support of the class ``AutoModelForCausalLM`` builds for this config.json (None: not known before
    loading, e.g. a model with remote code). Read from transformers' source files, not imported (seconds saved
    on every ``shardtune check``; tests/unit/test_transformers_tables.py compares it with the imported class)."""
    found = causal_lm_class_file(config)
    if found is None:
        return None
    name, path = found
    attributes = class_attributes(path, name) or {}
    source = path.read_text(encoding="utf-8")
    return KernelSupport(name, flash=bool(attributes.get("_supports_flash_attn")
                                          or attributes.get("_supports_flash_attn_2")),
                         sdpa=bool(attributes.get("_supports_sdpa")),
                         # transformers' attention modules hand sinks to the kernel as `s_aux=` (gpt_oss).
                         sinks="s_aux=" in source,
                         mask_per_layer_type="isinstance(causal_mask_mapping := attention_mask, dict)" in source,
                         prepared_mask=takes_prepared_mask(source, config), softcap="softcap=" in source,
                         attention_interface=bool(attributes.get("_supports_attention_backend")),
                         attention_dropout=drops_attention(config),
                         image_text=image_text_class_name(config) is not None,
                         bidirectional=config.get("is_decoder") is False)


def drops_attention(config: Mapping[str, Any]) -> bool:
    text = config.get("text_config")
    value = (text if isinstance(text, Mapping) else config).get("attention_dropout")
    return isinstance(value, (int, float)) and value > 0


def takes_prepared_mask(source: str, config: Mapping[str, Any]) -> bool:
    """Whether the modelling file ``source`` passes a 4-D mask on as given: it builds masks with transformers'
    masking_utils (or hands them to a language model built from its sub-config: Fuyu, GOT-OCR2), and computes no
    ALiBi positions from the 2-D mask (BLOOM; Falcon only with ``alibi: true`` in its config)."""
    builds_with_utils = "masking_utils" in source or "AutoModel.from_config(" in source
    alibi_from_mask = "build_alibi_tensor(attention_mask" in source.replace("self.", "") and config.get("alibi", True)
    return builds_with_utils and not alibi_from_mask


def causal_lm_class_file(config: Mapping[str, Any]) -> tuple[str, Path] | None:
    """(class name, modelling file) of the causal LM class for this config.json: the auto table's class for its
    model_type, else a class its ``architectures`` name, defined in that model type's modelling file."""
    model_type = str(config.get("model_type"))
    names = [image_text_class_name(config) or causal_lm_class_name(model_type), *(config.get("architectures") or [])]
    for name in names:
        path = find_class_file(model_type, str(name)) if name else None
        if path is not None:
            return str(name), path
    return None


def known_model_config(name: str, *, builds_tiny_model: bool = False) -> dict[str, Any] | None:
    """config.json of a local folder, or of a hub id already in the local cache; None when not known here.

    Nothing is downloaded: an uncached hub id is decided on each rank once it has loaded the config.
    ``builds_tiny_model``: the folder does not exist yet and will hold shardtune's tiny LLaMA.
    """
    if builds_tiny_model and not Path(name).exists():
        return {"model_type": "llama"}
    return model_config_json(name)


def flash_problem(has_cuda: bool, flash_installed: bool, split_size: int = 1) -> str | None:
    """Why a rank cannot run attn_implementation flash_attention_2 (one line), or None. Under a split
    (``split_size`` > 1) the split attention runs sdpa per segment, and flash there is sdpa's flash backend
    (FlashAttention-2 inside torch): a CUDA GPU, no flash-attn package (train/setup.py ``loaded_kernel``)."""
    key = "attn_implementation (flash_attention_2, flash_attn: fa2)"
    if split_size > 1:
        if has_cuda:
            return None
        return (f"{key} with sequence_parallel_size ({split_size}): the split attention runs sdpa's flash kernel, "
                "which needs a CUDA GPU; none is visible here. Use flash_attn: sdpa (or attn_implementation: sdpa)")
    if not has_cuda:
        return f"{key} needs a CUDA GPU; none is visible here. Use flash_attn: sdpa (or attn_implementation: sdpa)"
    if not flash_installed:
        return f"{key} needs the flash-attn package: pip install flash-attn, or use flash_attn: sdpa"
    return None


def flash_available(has_cuda: bool) -> bool:
    return has_cuda and importlib.util.find_spec("flash_attn") is not None


def choose_attention(requested: str, support: KernelSupport | None, *, flash_usable: bool,
                     model: str, splits_sequences: bool = False, varlen_usable: bool = False) -> AttentionChoice:
    """The kernel for ``requested`` (``auto`` or an explicit one); a ModelError when the model cannot run it.
    ``splits_sequences``: sequence_parallel_size > 1, whose split attention runs sdpa, so ``auto`` takes no flash
    kernel. ``varlen_usable``: rows packed with sample boundaries, on a CUDA GPU, in bf16 or fp16 (the varlen
    kernel's case: ``auto_choice``)."""
    if requested != AUTO:
        problem = kernel_problem(requested, support, model)
        if problem:
            raise ModelError(problem)
        return AttentionChoice(requested, "asked for (attn_implementation / flash_attn)")
    if support is None:
        return AttentionChoice("eager", "auto: the model class is unknown before loading (remote code), and eager "
                                        "is the kernel every model runs")
    if support.flash and flash_usable and not support.sinks and not splits_sequences:
        return AttentionChoice("flash_attention_2", f"auto: {support.model_class} supports flash attention, "
                                                    "flash-attn is installed and a CUDA GPU is used")
    if varlen_usable and not splits_sequences and varlen_problem(support, model) is None:
        return AttentionChoice(VARLEN, f"auto: packed rows on a CUDA GPU, and {support.model_class} passes sample "
                                       "offsets to torch's varlen flash kernel (no [B, 1, L, L] mask); flash-attn is "
                                       "not installed")
    why_not_flash = ("sequence_parallel_size splits attention with sdpa" if splits_sequences
                     else "flash-attn 2 would drop its attention sinks" if support.sinks
                     else "flash-attn is not usable here (needs the package and a CUDA GPU)")
    if support.sdpa:
        return AttentionChoice("sdpa", f"auto: {support.model_class} supports sdpa; {why_not_flash}")
    return AttentionChoice("eager", f"auto: {support.model_class} does not support sdpa; {why_not_flash}")


def auto_choice(config: Mapping[str, Any], *, has_cuda: bool, model: str, splits_sequences: bool = False,
                packed_half_rows: bool = False) -> AttentionChoice:
    """What ``auto`` picks for the model whose config.json is ``config`` (the launching host and a rank alike);
    ``splits_sequences``: sequence_parallel_size > 1 (no flash kernel then); ``packed_half_rows``: the run packs
    rows with sample boundaries in bf16 or fp16 (data/settings.py ``packs_half_rows``)."""
    return choose_attention(AUTO, kernel_support(config), flash_usable=flash_available(has_cuda), model=model,
                            splits_sequences=splits_sequences,
                            varlen_usable=has_cuda and packed_half_rows and versions.varlen_attn_available())


def kernel_problem(kernel: str, support: KernelSupport | None, model: str) -> str | None:
    """Why ``model`` cannot train with ``kernel`` (None when it can, or when its class is unknown; varlen refuses an
    unknown class: ``varlen_problem``)."""
    if kernel == VARLEN:
        return varlen_problem(support, model)
    if support is None or kernel == "eager":
        return None
    key = f"attn_implementation ({kernel}; flash_attn: {FLASH_ATTN_SPELLING[kernel]})"
    fix = "use flash_attn: auto (or attn_implementation: auto) to pick a kernel it supports"
    if kernel == "sdpa" and not support.sdpa:
        return f"{key}: {support.model_class} ({model}) does not support sdpa; {fix}, or flash_attn: disabled (eager)"
    if kernel == "flash_attention_2" and not support.flash:
        return f"{key}: {support.model_class} ({model}) does not support flash attention; {fix}"
    if kernel == "flash_attention_2" and support.sinks:
        return (f"{key}: {support.model_class} ({model}) has attention sinks, which the flash-attn 2 kernel does "
                f"not take (transformers would drop them and train a different model); {fix}, or flash_attn: "
                "disabled (eager)")
    return None


def varlen_problem(support: KernelSupport | None, model: str) -> str | None:
    """Why ``model`` cannot train under torch's varlen kernel (model/varlen.py), or None. A model that does not
    pass the offsets on would attend across packed samples without a word, so an unknown class is refused too."""
    key, fix = "attn_implementation (varlen)", "use attn_implementation: auto (or sdpa)"
    if support is None:
        return (f"{key}: {model}'s class is not known before loading (remote code), so whether its attention takes "
                f"sample offsets cannot be checked; {fix}")
    name = f"{support.model_class} ({model})"
    if not (support.flash and support.attention_interface):
        return (f"{key}: {name} does not pass sample offsets to a registered attention kernel (transformers' "
                f"flash-attention and attention-backend support); {fix}")
    blocker = ("has attention sinks" if support.sinks else "softcaps its attention logits" if support.softcap
               else "drops attention probabilities (attention_dropout > 0)" if support.attention_dropout
               else "is an image-text model, whose vision tower attends under the same kernel" if support.image_text
               else "attends both ways (is_decoder: false)" if support.bidirectional
               else None)
    return f"{key}: {name} {blocker}, which the varlen kernel does not compute; {fix}" if blocker else None


def varlen_device_problem(kernel: str, *, has_cuda: bool, half_precision: bool) -> str | None:
    """On a CUDA GPU varlen runs torch's varlen_attn: torch 2.10 or later, bf16 or fp16."""
    if kernel != VARLEN or not has_cuda:
        return None
    if not versions.varlen_attn_available():
        found = versions.installed_version("torch") or "(not installed)"
        return (f"attn_implementation (varlen) on a CUDA GPU runs torch's varlen_attn, which torch {found} lacks "
                "(2.10 or later has it); use attn_implementation: sdpa")
    if not half_precision:
        return ("attn_implementation (varlen) on a CUDA GPU runs the flash kernel, which takes bf16 or fp16 only; "
                "set bf16: true (or fp16: true), or use attn_implementation: sdpa")
    return None


def layer_windows(config: Any) -> dict[str, int | None]:
    """Each kind of attention layer in the model -> its sliding window (None: attends to the whole sample).

    Reads ``layer_types`` where the config has it (models mixing local and global layers), else one kind for
    every layer: sliding when ``sliding_window`` is set (Mistral), full otherwise.
    """
    language = _get(config, "text_config") or config  # multimodal configs (Gemma 3) nest the language model's
    window = _get(language, "sliding_window")
    if window and not applies_sliding_window(config):  # the class's file is read only where a window is stated
        window = None
    layer_types = _get(language, "layer_types")
    if layer_types:
        return {kind: (window if kind == SLIDING else None) for kind in dict.fromkeys(layer_types)}
    return {SLIDING: window} if window else {FULL: None}


def applies_sliding_window(config: Any) -> bool:
    """Whether the model's class applies the ``sliding_window`` its config states. Moshi's states 3,000 (16 in a
    tiny model) and transformers' Moshi builds a plain causal mask: a packed row's mask with the window would make
    its samples attend to fewer tokens than the same samples padded. Read from the class's modelling file (a
    sliding-window mask, or a window passed to the attention kernel); a class not found here (remote code) is
    taken at its config's word."""
    fields = config if isinstance(config, Mapping) else getattr(config, "to_dict", lambda: vars(config))()
    found = causal_lm_class_file(fields)
    return found is None or _source_applies_window(found[1])


@functools.cache
def _source_applies_window(path: Path) -> bool:
    source = path.read_text(encoding="utf-8")
    return "create_sliding_window_causal_mask" in source or "sliding_window=" in source


# Per-layer descriptions in configs of hybrid models (Qwen3-Next, Nemotron-H, RecurrentGemma, ...).
LAYER_KIND_KEYS = ("layer_types", "layers_block_type", "block_types")
# Config keys that only models with state-space or linear-attention layers have (pure Mamba/RWKV configs list no
# layer kinds).
STATE_SIZE_KEYS = ("ssm_state_size", "state_size", "mamba_d_state", "linear_key_head_dim", "conv_L_cache",
                   "attention_hidden_size")


def stateful_layer_kinds(config: Any) -> list[str]:
    """The model's layer kinds that carry a state along the sequence (linear attention, Mamba, recurrent, short
    convolutions): no attention mask bounds them, so packed rows run them once per sample (model/packed_state.py)
    and sequence parallelism, which would have to pass the state from rank to rank, refuses them."""
    config = _get(config, "text_config") or config
    kinds: dict[str, None] = {}
    for key in LAYER_KIND_KEYS:
        values = _get(config, key)
        if isinstance(values, (list, tuple)):
            kinds.update({str(v): None for v in values if _carries_state(str(v))})
    if not kinds and any(_get(config, key) for key in STATE_SIZE_KEYS):
        kinds["state-space"] = None
    return list(kinds)


def _carries_state(kind: str) -> bool:
    if kind in ("mlp", "moe", "dense", "none"):
        return False
    return "linear" in kind or "attention" not in kind


def recurrent_kinds(kinds: Iterable[str]) -> frozenset[str]:
    """The layer kinds (keys of ``layer_windows``) whose layers hold a state and no attention (linear attention,
    Mamba, short convolutions): they run once per packed sample (model/packed_state.py) and take no block mask.
    Hybrid kinds ("hybrid": Mamba beside a shared attention) attend too, so they are not among them."""
    return frozenset(kind for kind in kinds if _carries_state(kind) and "hybrid" not in kind)


# Families with stateful layers whose packed rows shardtune cannot keep apart, and why (found with transformers 5.23;
# tests/unit/test_packed_state.py checks every other family with such layers against each sample trained alone).
_OWN_MASK_NAMES = ("its layers read their masks under names of their own (full_attention, linear_attention) rather "
                   "than the layer kinds its config lists (hybrid, linear_attention), so the block mask that keeps "
                   "packed samples apart cannot reach its hybrid layers")
PACKING_NOT_EXACT: dict[str, str] = {"zamba": _OWN_MASK_NAMES, "zamba2": _OWN_MASK_NAMES}


def packing_problem(config: Mapping[str, Any], support: KernelSupport | None, kernel: str, model: str) -> str | None:
    """Why packed rows of ``model`` cannot stay isolated under ``kernel`` (None when they can). Layers with a state
    (stateful_layer_kinds) run once per sample (model/packed_state.py), so they alone refuse nothing."""
    family = str(_get(_get(config, "text_config") or config, "model_type"))
    if family in PACKING_NOT_EXACT and stateful_layer_kinds(config):
        return (f"packing: {model or 'the model'} ({family}) has {', '.join(stateful_layer_kinds(config))} layers, "
                f"and {PACKING_NOT_EXACT[family]}; set packing: false (padding_free is off for it)")
    if support is not None and not support.prepared_mask:
        return (f"packing: {support.model_class} ({model or 'the model'}) builds its attention mask itself from a "
                "2-D padding mask, so the block mask that keeps packed samples apart cannot reach it; set packing: "
                "false (padding_free is off for it)")
    if takes_offsets(kernel):
        return None  # varlen offsets bound every layer, and the kernel applies each layer's own window
    kinds = layer_windows(config)
    unknown = sorted(set(kinds) - {FULL, SLIDING} - recurrent_kinds(kinds))
    if unknown:
        return (f"packing with attn_implementation ({kernel}): {model} has {', '.join(unknown)} layers, for which "
                "shardtune cannot build a mask that keeps packed samples apart; set packing: false")
    if len(kinds) > 1 and support is not None and not support.mask_per_layer_type:
        return (f"packing with attn_implementation ({kernel}): {support.model_class} ({model}) mixes local and "
                "global layers but takes one mask for all of them, so its local layers would see across samples; "
                "set packing: false")
    return None


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def dense_mask_fallback_warning(packed: bool, on_cuda: bool, kernel: str) -> str | None:
    """The run-log line for packed rows on a GPU whose kernel takes them as a dense ``[B, 1, L, L]`` mask."""
    if not packed or not on_cuda or takes_offsets(kernel):
        return None
    return (f"[shardtune] warning: packed rows on a GPU under attn_implementation {kernel} use a dense [B, 1, L, L] "
            "block mask (memory and time grow with L^2, and the causal flash kernel is not used); use "
            "attn_implementation: varlen (torch's varlen flash kernel, bf16 or fp16) or auto, install flash-attn "
            "(flash_attn: fa2), or set packing: false")
