"""The model families `make-tiny-model --arch` builds: each a tiny random model from that family's own
transformers config class, with the features that break distributed training kept (tied embeddings, sliding
windows, local/global layers, mixture-of-experts blocks, latent attention, attention sinks).

Sizes are small so two CPU processes train them in seconds, but every structural feature is present: MoE models
have more experts than they route to (so ranks can route differently), sliding windows are shorter than a packed
row (so isolation is really tested), DeepSeek-V3 mixes a dense first layer with MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING_WINDOW = 16  # tokens: shorter than the test rows, so a window that leaks across samples shows


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' config name (AutoConfig.for_model)
    template: str  # shardtune template name (LLaMA-Factory's)
    config: dict[str, Any] = field(default_factory=dict)  # on top of the common tiny sizes
    note: str = ""


_MOE = {"num_experts_per_tok": 2, "output_router_logits": False}
_HYBRID = {"sliding_window": SLIDING_WINDOW, "layer_types": ["sliding_attention", "full_attention"]}

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "llama3", {"tie_word_embeddings": False}),
    "qwen2": Family("qwen2", "qwen", {"tie_word_embeddings": False}),
    "qwen3": Family("qwen3", "qwen3", {"tie_word_embeddings": True, "head_dim": 16},
                    "tied embeddings (as Qwen3-0.6B to 4B)"),
    "qwen3_moe": Family("qwen3_moe", "qwen3", {**_MOE, "num_experts": 4, "moe_intermediate_size": 32,
                                               "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 16},
                        "sparse MoE block, fused expert weights"),
    "mistral": Family("mistral", "mistral", {"sliding_window": SLIDING_WINDOW, "head_dim": 16},
                      "sliding-window attention on every layer"),
    "mixtral": Family("mixtral", "mistral", {**_MOE, "num_local_experts": 4, "head_dim": 16},
                      "sparse MoE block, fused expert weights"),
    "gemma2": Family("gemma2", "gemma", {**_HYBRID, "head_dim": 16, "tie_word_embeddings": True},
                     "local/global layers, logit soft-capping (eager attention only), tied embeddings"),
    "gemma3": Family("gemma3_text", "gemma3", {**_HYBRID, "head_dim": 16, "tie_word_embeddings": True},
                     "local/global layers, tied embeddings (text model)"),
    "phi3": Family("phi3", "phi", {"tie_word_embeddings": False}, "fused qkv and gate/up projections"),
    "deepseek_v3": Family("deepseek_v3", "deepseek3", {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "moe_intermediate_size": 32, "kv_lora_rank": 16, "q_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "rope_scaling": None,
        "num_key_value_heads": 4, "tie_word_embeddings": False},  # latent attention: as many kv heads as heads
        "multi-head latent attention, a dense first layer then MoE layers"),
    "gpt_oss": Family("gpt_oss", "gpt_oss", {**_MOE, **_HYBRID, "num_local_experts": 4, "head_dim": 16,
                                             "tie_word_embeddings": False},
                      "fused experts with biases, attention sinks, local/global layers (eager attention only)"),
    "glm4": Family("glm4", "glm4", {"tie_word_embeddings": False, "head_dim": 16}, "fused gate/up projection"),
}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown architecture {name!r}; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def tiny_config(name: str, *, tokenizer: Any, layers: int, hidden: int, heads: int, kv_heads: int,
                intermediate: int, max_positions: int) -> Any:
    """The family's transformers config at tiny sizes, with the tokenizer's vocabulary and special ids."""
    from transformers import AutoConfig

    spec = family(name)
    sizes = {"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": intermediate,
             "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "max_position_embeddings": max_positions, "bos_token_id": tokenizer.bos_token_id,
             "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
             # Larger than the usual 0.02 so the output head can express a peaked distribution: with a
             # 64-wide model and 0.02, logits stay near uniform and LoRA (head frozen) cannot lower the loss.
             "initializer_range": 0.1}
    extra = dict(spec.config)
    if "layer_types" in extra:  # one pattern repeated over the layers: local, global, local, ...
        pattern = extra["layer_types"]
        extra["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return AutoConfig.for_model(spec.model_type, **{**sizes, **extra})
