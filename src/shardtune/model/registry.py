"""Every decoder family the installed transformers ships, read from its own registry, and a tiny config of each.

``model/architectures.py`` lists the families the engine matrix was written for, with hand-chosen sizes. This
module is the other half: the families transformers itself maps to a causal-LM class (``AutoModelForCausalLM``),
so that a new transformers release brings its new families into the tests without anyone writing their names.
A tiny config keeps each family's structure (its layer kinds, experts, latent attention) and shrinks its sizes:
the per-layer lists (``layer_types``, hybrid patterns) keep one layer of each kind. A family whose default these
rules cannot shrink (a size under a name of its own, a default that does not build at all) has its fields in
``FAMILY_OVERRIDES``, each with the reason.
"""

from __future__ import annotations

from typing import Any

from shardtune.model.attention import LAYER_KIND_KEYS
from shardtune.model.composite import IMAGE_TEXT_TABLE

# Sizes set wherever a config has the attribute (read from its own fields: aliases such as n_embd resolve through
# attribute_map when the config is built again with them).
TINY_SIZES: dict[str, int] = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
    "mamba_d_state": 16, "n_groups": 1, "sliding_window": 16, "rotary_dim": 8, "hidden_size_per_layer_input": 16,
    "d_model": 64, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128, "encoder_layers": 2, "decoder_layers": 2,
    # image-text towers: the vision features' width where it is its own field (the projector maps it onward)
    "vision_output_dim": 64, "projector_input_dim": 64, "projector_output_dim": 64,
    # BLT: its local byte models read the width of its global (patch) model, shrunk as every hidden_size
    "hidden_size_global": 64,
    # Jamba-style periods: an attention layer and an expert layer among the two kept
    "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
    # widths under names of their own (left at full size, they were most of a tiny model's compute: Kimi-Linear's
    # 32 x 128 linear-attention heads on a 64-wide model took 70-110 s a matrix cell, CPM-Ant's 10,240-wide FFN)
    "ffn_dim": 128, "dim_ff": 128, "dff": 128, "d_inner": 128, "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128, "shared_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "dim_head": 16, "linear_num_heads": 4, "linear_head_dim": 16, "o_lora_rank": 32, "state_size": 16,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    # encoder-decoder families whose decoder is the causal LM (ProphetNet: 12 layers of 16 heads by default)
    "num_encoder_layers": 2, "num_decoder_layers": 2, "num_encoder_attention_heads": 4,
    "num_decoder_attention_heads": 4,
}
# Sizes a default may leave unset (None) that the modelling code needs: a derived head size, the experts per token
# (DeepSeek-V2's default routes to None experts), dots.llm1's experts (None, yet every layer is an expert layer)
# and Nemotron's kv heads (None, yet divided by).
UNSET_SIZES = ("head_dim", "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "num_key_value_heads")
# Per-layer descriptions: a list (or a string, one character per layer) as long as the layer count.
PER_LAYER_HINTS = (*LAYER_KIND_KEYS, "hybrid_override_pattern")
# Lists of layer indices (the layers of one kind): renumbered onto the layers kept.
LAYER_INDEX_LISTS = ("mlp_only_layers", "attn_layer_indices", "full_attn_idxs", "global_attn_layers")
SUB_CONFIGS = ("text_config", "vision_config", "audio_config",
               "patcher_config", "encoder_config", "decoder_config", "global_config")  # BLT's byte and patch models
# Fields of one family (by a config's own model_type, so a composite's text config gets its family's entry) that
# the generic shrinking cannot reach or gets wrong: set after it.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # its sliding layers' latent attention has sizes of its own, read from swa_* fields; the indexer's too
    "dots3_note_text": {
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 32, "swa_kv_lora_rank": 16,
        "swa_head_dim": 24, "swa_qk_nope_head_dim": 16, "swa_qk_rope_head_dim": 8, "swa_v_head_dim": 16,
        "index_n_heads": 2, "index_head_dim": 16, "index_topk": 16, "shared_experts_intermediate_size": 32,
    },
    # its vision and audio adapters must map the towers' widths into the text model's
    "dots3_note_vision_encoder": {"adapter_in_dim": 64, "adapter_out_dim": 64},
    "dots3_note_audio_encoder": {"adapter_input_size": 64, "adapter_out_dim": 64},
    # num_hidden_layers is derived (twice num_layers: two attention sublayers a layer), the zero (identity)
    # experts are a count of their own, and the rotary size is head_dim (the latent heads' rope part)
    "longcat_flash": {"num_layers": 1, "zero_expert_num": 2, "head_dim": 8},
    # hash embeddings of byte n-grams: one table per n-gram size, each this long
    "blt": {"encoder_hash_byte_group_vocab": 64},
    # its default leaves rope_parameters empty, yet the model reads one entry per layer type (None: no RoPE)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # the attention reads rope_theta from attn_config, a field its class does not declare, and clamps with
    # clip_qkv, whose default None fails (DBRX's checkpoints carry both: 500000, 8); the experts sit in ffn_config
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 500000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
    # its default leaves layer_types unset, yet each layer reads its kind (conv or attention) from it: a dense
    # layer, then expert layers with a convolution and with attention
    "lfm2_moe": {"num_hidden_layers": 3, "num_dense_layers": 1, "layer_types": ["conv", "full_attention", "conv"]},
    # its layer kinds are derived from full_attn_idxs, which the shrinking renumbers onto attention layers only:
    # a convolution layer and an attention layer, as its checkpoints mix them
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    # its defaults leave the token indexer of its indexed-attention layers unset (None), yet the layers build one;
    # the hyper-connections' low rank is a width of its own
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
                       "indexer_compress_ratio": 4, "hc_lowrank": 16},
    # its router picks exactly one expert per token (the config refuses any other number); its router's own width
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 32},
    # one attention block shared by every hybrid layer (tied to the first's): two hybrid layers keep the sharing;
    # the attention's width and the Mamba step rank are stated, not derived, in its default
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2,
              "attention_hidden_size": 128, "mamba_dt_rank": 4},
    # a Conformer audio encoder whose blocks and convolution channels have names of their own
    "phi4_multimodal_audio": {"num_blocks": 2, "ext_pw_out_channel": 64, "depthwise_separable_out_channel": 64,
                              "nemo_conv_channels": 64},
}


def decoder_families() -> list[str]:
    """Model types the installed transformers builds a causal LM for, from its own auto table."""
    from shardtune.model.transformers_tables import table

    return sorted(table("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"))


def image_text_families() -> list[str]:
    """Model types the installed transformers builds an image-text-to-text model for, from its own auto table."""
    from shardtune.model.transformers_tables import table

    return sorted(table(IMAGE_TEXT_TABLE))


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """The config fields a tiny model takes from its tokenizer's special tokens."""
    return {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id}


def tiny_registry_config(model_type: str, vocab_size: int, special_ids: dict[str, int] | None = None) -> Any:
    """The family's default config built again with tiny sizes (so derived fields follow), sub-configs
    (``text_config``, ``vision_config``) shrunk the same way."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    kwargs = tiny_kwargs(default, vocab_size, special_ids or {})
    for name in SUB_CONFIGS:
        sub = vars(default).get(name)
        if sub is not None and hasattr(sub, "to_dict"):
            fields = sub.to_dict()
            fields.pop("per_layer_config", None)  # derived from the full-size layers; rebuilt from the kept ones
            kwargs[name] = {**fields, **tiny_kwargs(sub, vocab_size, special_ids or {})}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_image_text_config(model_type: str, vocab_size: int, special_ids: dict[str, int] | None = None) -> Any:
    """An image-text family's tiny config with a vision tower (a family whose default has none, Gemma 4, gets its
    own default tower), the tower's output width that of the language model, and multimodal RoPE sections that fit
    the tiny heads."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    vision_class = (getattr(type(default), "sub_configs", None) or {}).get("vision_config")
    tower = getattr(default, "vision_config", None) or (vision_class() if vision_class else None)
    tiny = tiny_registry_config(model_type, vocab_size, special_ids)
    text = tiny.get_text_config()
    if tower is not None and getattr(tiny, "vision_config", None) is None:
        fields = {**tower.to_dict(), **tiny_kwargs(tower, vocab_size, special_ids or {})}
        rebuilt = {key: value for key, value in tiny.to_dict().items() if key != "model_type"}
        tiny = AutoConfig.for_model(model_type, **{**rebuilt, "vision_config": fields})
        text = tiny.get_text_config()
    vision = getattr(tiny, "vision_config", None)
    if vision is not None and type(getattr(vision, "out_hidden_size", None)) is int:
        vision.out_hidden_size = text.hidden_size  # Qwen's merger projects straight into the language model
    if vision is not None and type(vars(vision).get("embed_dim")) is int:
        vision.embed_dim = TINY_SIZES["d_model"]  # Qwen2-VL's tower width (a text config's embed_dim is an alias)
    _fit_mrope_sections(text)
    return tiny


def _fit_mrope_sections(text: Any) -> None:
    """Multimodal RoPE splits each head's rotary half into (time, height, width) sections whose sizes the modelling
    file defaults for the full-size heads; scale them to the tiny heads (kept where they cannot all be non-zero)."""
    if "mrope_section" not in getattr(type(text), "ignore_keys_at_rope_validation", ()):
        return
    rope = dict(getattr(text, "rope_parameters", None) or {})
    sections = rope.get("mrope_section") or [16, 24, 24]  # Qwen2-VL .. Qwen3.5's modelling default
    head_dim = vars(text).get("head_dim") or text.hidden_size // text.num_attention_heads
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    if half < len(sections) or sum(sections) == half:
        return
    scaled = [max(1, section * half // sum(sections)) for section in sections]
    scaled[-1] += half - sum(scaled)
    text.rope_parameters = {**rope, "mrope_section": scaled}


def tiny_kwargs(config: Any, vocab_size: int, special_ids: dict[str, int]) -> dict[str, Any]:
    """The fields to change: tiny sizes, the tokenizer's vocabulary and special ids, one layer of each kind."""
    aliases = getattr(config, "attribute_map", {}) or {}
    own = {key: value for key, value in vars(config).items() if not key.startswith("_")}
    own.update({name: own[field] for name, field in aliases.items() if field in own})  # n_embd read as hidden_size
    kwargs: dict[str, Any] = {aliases.get(key, key): value for key, value in TINY_SIZES.items()
                              if key in own and (type(own[key]) is int or own[key] is None and key in UNSET_SIZES)}
    expand = own.get("expand", own.get("mamba_expand"))
    if type(expand) is int:  # Mamba: the inner width (expand x hidden) is heads x head size
        inner = expand * TINY_SIZES["hidden_size"]
        for heads, size in (("num_heads", "head_dim"), ("mamba_n_heads", "mamba_d_head"),
                            ("mamba_num_heads", "mamba_head_dim")):
            if heads in own and size in own:
                kwargs[heads] = inner // TINY_SIZES[size] if size in TINY_SIZES else own[heads]
                kwargs[size] = TINY_SIZES.get(size, 16)
        if type(own.get("mamba_d_ssm")) is int:  # Falcon-H1 states the inner width too
            kwargs["mamba_d_ssm"] = inner
    if "kv_lora_rank" in own:  # latent attention: one kv head per head, head sizes derived from the ranks
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    if "vocab_size" in own:
        kwargs["vocab_size"] = vocab_size
        if type(own.get("vocab_size_per_layer_input")) is int:  # Gemma 3n/4's per-layer embeddings
            kwargs["vocab_size_per_layer_input"] = vocab_size
        kwargs.update({key: value for key, value in special_ids.items() if key in own})
    layers = own.get("num_hidden_layers")
    if isinstance(layers, int) and layers > 0:
        kwargs.update({aliases.get(k, k): v for k, v in layer_kwargs(config, own, layers).items()})
    kwargs.update(FAMILY_OVERRIDES.get(getattr(config, "model_type", ""), {}))
    return kwargs


def layer_kwargs(config: Any, own: dict[str, Any], layers: int) -> dict[str, Any]:
    kept = kept_layers(config, layers)
    found: dict[str, Any] = {"num_hidden_layers": len(kept)}
    for key in (*PER_LAYER_HINTS, *_per_layer_keys(own, layers)):
        value = own.get(key)
        if isinstance(value, (list, str)) and len(value) == layers:
            picked = [value[i] for i in kept]
            if key in TINY_SIZES and all(type(size) is int for size in picked):  # Gemma 3n's widths by layer
                picked = [TINY_SIZES[key]] * len(kept)
            found[key] = "".join(picked) if isinstance(value, str) else picked
    for key in LAYER_INDEX_LISTS:
        if isinstance(own.get(key), list):
            found[key] = [new for new, old in enumerate(kept) if old in own[key]]
    if isinstance(own.get("per_layer_config"), dict):  # Gemma 4: overrides by layer index
        found["per_layer_config"] = {new: own["per_layer_config"][old] for new, old in enumerate(kept)
                                     if old in own["per_layer_config"]}
    if type(own.get("num_kv_shared_layers")) is int:  # Gemma 3n: the last layers reuse earlier layers' caches
        found["num_kv_shared_layers"] = sum(_reuses_cache(config, i, layers) for i in kept)
    if key_kinds := found.get("layer_types"):
        found["layer_types"] = _with_attention(key_kinds)
    if "attn_layer_indices" in own and not found.get("attn_layer_indices"):
        found["attn_layer_indices"] = [len(kept) - 1]  # hybrid defaults with no attention layer at all
    return found


def _with_attention(kinds: list[Any]) -> list[Any]:
    """A hybrid whose default pattern has only linear-attention layers (Granite 4.0's) gets one attention layer:
    real checkpoints mix both, and the model's cache needs one."""
    if kinds and all(kind == "linear_attention" for kind in kinds):
        return [*kinds[:-1], "full_attention"]
    return kinds


def kept_layers(config: Any, layers: int) -> list[int]:
    """Indices of the first layer of each kind (by every per-layer description), padded to two layers."""
    kinds = [(*(_layer_kind(config, key, i, layers) for key in (*PER_LAYER_HINTS, *LAYER_INDEX_LISTS)),
              _reuses_cache(config, i, layers)) for i in range(layers)]
    first = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())
    extra = [i for i in range(layers) if i not in first]
    return sorted(first + extra[:max(0, 2 - len(first))])


def _reuses_cache(config: Any, index: int, layers: int) -> bool:
    """Whether a layer reads another layer's keys and values (the last ``num_kv_shared_layers`` do): a tiny model
    keeps a layer of each kind on both sides, as the model needs a producer for every kind it shares."""
    shared = vars(config).get("num_kv_shared_layers")
    return type(shared) is int and index >= layers - shared


def _layer_kind(config: Any, key: str, index: int, layers: int) -> Any:
    try:
        value = getattr(config, key, None)  # properties too: Nemotron-H's pattern is derived
    except Exception:  # a per-layer attribute that refuses a global read (Gemma 4)
        value = vars(config).get(key)
    if key in LAYER_INDEX_LISTS:
        return index in value if isinstance(value, list) else None
    return value[index] if isinstance(value, (list, str)) and len(value) == layers else None


def _per_layer_keys(own: dict[str, Any], layers: int) -> list[str]:
    """Other list fields with one entry per layer (window sizes, rope kinds): cut with the layers."""
    return [key for key, value in own.items() if key not in PER_LAYER_HINTS and key not in LAYER_INDEX_LISTS
            and isinstance(value, list) and len(value) == layers and layers > 2]
