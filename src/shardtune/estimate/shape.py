"""The shape of a LLaMA-style decoder read from its config.json, and exact parameter counts.

Only json is used (no transformers import): `shardtune estimate` and `shardtune check` must stay fast and
must work for models whose weights are not on this machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from shardtune.errors import ConfigError, ModelError
from shardtune.estimate.vision_shape import VisionShape, vision_from_config
from shardtune.model.folder import model_config_json
from shardtune.model.moe import expert_count

# Linear layers of one LLaMA decoder layer, by the names LoRA's lora_target uses.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES
# Other families' nn.Linear names: fused projections (Phi-3, GLM-4) and latent attention (DeepSeek-V3).
FUSED_ATTENTION_MODULES = ("qkv_proj", "o_proj")
FUSED_MLP_MODULES = ("gate_up_proj", "down_proj")
MLA_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLA_NO_Q_LORA_MODULES = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

# Model types whose q/k/v projections always carry a bias, whatever `attention_bias` says.
QKV_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text"})
# GLM-4's attention_bias gives q/k/v a bias but never o_proj.
NO_O_BIAS_MODEL_TYPES = frozenset({"glm4"})
# Four RMSNorms per layer (around attention and around the MLP) instead of two.
FOUR_NORM_MODEL_TYPES = frozenset({"gemma2", "gemma3_text", "glm4"})
# RMSNorm over each head's q and k (head_dim weights each).
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3_text", "qwen3_vl_text", "qwen3_vl_moe_text"})
FUSED_QKV_MODEL_TYPES = frozenset({"phi3"})
FUSED_GATE_UP_MODEL_TYPES = frozenset({"phi3", "glm4"})
# One learned attention-sink logit per head and layer (GPT-OSS).
SINK_MODEL_TYPES = frozenset({"gpt_oss"})
# Families whose transformers config ties the embedding and the head when config.json does not say.
TIED_BY_DEFAULT_MODEL_TYPES = frozenset({"gemma", "gemma2", "gemma3_text"})
# Families whose counts were checked equal to the model transformers builds (tests/unit/test_estimate_architectures.py
# at real sizes; qwen2_moe, deepseek_v2 and glm4_moe at tiny sizes; the Qwen VL language models at tiny sizes in
# tests/unit/test_estimate_vision.py). Others are read as LLaMA-style decoders with
# the keys above, and the report says their counts are approximate (OLMoE's full-width q/k norms, Llama 4's
# interleaved MoE, Qwen3-Next's linear attention are not modelled).
CHECKED_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma2",
                                 "gemma3_text", "phi3", "deepseek_v2", "deepseek_v3", "gpt_oss", "glm4", "glm4_moe",
                                 "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text"})
# Checkpoint dtypes by their config.json name; anything else counts as 4 bytes (an upper bound).
CHECKPOINT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MoeShape:
    """A sparse mixture-of-experts block: a router scores ``experts`` experts and each token runs ``top_k``.

    transformers 5 stores the experts fused, as 3-D parameters (gate_up_proj [E, 2i, h] and down_proj [E, h, i])
    that are not nn.Linear modules; the router is not an nn.Linear either. Every expert is resident and trains
    under full fine-tuning; a token's activations go through ``top_k`` of them (plus the shared experts).
    """

    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int = 0  # the always-on shared expert(s) as one MLP of this width (DeepSeek, Qwen2-MoE)
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert: Linear(h, 1)
    router_bias: bool = False  # GPT-OSS
    expert_bias: bool = False  # GPT-OSS: gate_up_proj_bias [E, 2i], down_proj_bias [E, h]
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP (DeepSeek's first_k_dense_replace, mlp_only_layers)
    aux_loss: bool = False  # a load-balancing loss over the router logits (router_aux_loss_coef; not DeepSeek-V3's)
    clamped_swiglu: bool = False  # GPT-OSS: clamp, sigmoid-gated GLU and (up + 1) keep five i-wide tensors, not two

    def expert_params(self, h: int) -> int:
        """One expert: gate and up (h -> i each) and down (i -> h), with GPT-OSS's biases."""
        i = self.expert_intermediate
        return 3 * h * i + ((2 * i + h) if self.expert_bias else 0)

    def router_params(self, h: int) -> int:
        return self.experts * h + (self.experts if self.router_bias else 0)


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2/V3): q and kv go through low-rank latents with their own norms."""

    q_lora_rank: int  # 0: q is projected directly (q_proj)
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_rope_head_dim + self.qk_nope_head_dim


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about a decoder-only transformer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    source: str = ""
    checkpoint_bytes: int = 4  # bytes per weight in the checkpoint files (config.json's dtype; fp32 if unknown)
    norms_per_layer: int = 2
    qk_norm: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    attention_sinks: bool = False
    attn_softcapping: bool = False  # Gemma 2: tanh soft-capping of the attention scores (eager attention)
    moe: MoeShape | None = None
    mla: MlaShape | None = None
    sliding_window: int | None = None
    sliding_layers: int = 0  # layers that attend within the window (the others attend globally)
    score_head: bool = False  # stage rm: a one-row score layer replaces the output projection (model/reward_head.py)
    vision: VisionShape | None = None  # an image-text checkpoint's vision tower and projector (vision_shape.py)

    def as_reward_model(self) -> ModelShape:
        """The same body under a reward model's one-row score head (no vocabulary logits, no output matrix)."""
        return replace(self, score_head=True)

    @property
    def output_rows(self) -> int:
        """Rows of the output layer, the width of the logits: the vocabulary, or a reward model's one score."""
        return 1 if self.score_head else self.vocab_size

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_width(self) -> int:
        """Width of q (and of the attention output): heads x head_dim; with MLA, heads x (nope + rope)."""
        return self.num_heads * (self.mla.qk_head_dim if self.mla else self.head_size)

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_size

    @property
    def attn_out_width(self) -> int:
        """Width of the attention output that o_proj reads (heads x v_head_dim with MLA)."""
        return self.num_heads * self.mla.v_head_dim if self.mla else self.q_width

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index not in self.moe.dense_layers

    @property
    def moe_layers(self) -> int:
        return sum(1 for i in range(self.num_layers) if self.is_moe_layer(i))

    def attention_linear_shapes(self) -> dict[str, tuple[int, int, bool]]:
        """(in_features, out_features, has_bias) of each nn.Linear of one attention block."""
        h, q, k = self.hidden_size, self.q_width, self.kv_width
        if self.mla:
            m = self.mla
            kv_a = (h, m.kv_lora_rank + m.qk_rope_head_dim, self.qkv_bias)
            kv_b = (m.kv_lora_rank, self.num_heads * (m.qk_nope_head_dim + m.v_head_dim), False)
            o = (self.attn_out_width, h, self.o_bias)
            if m.q_lora_rank:
                return {"q_a_proj": (h, m.q_lora_rank, self.qkv_bias), "q_b_proj": (m.q_lora_rank, q, False),
                        "kv_a_proj_with_mqa": kv_a, "kv_b_proj": kv_b, "o_proj": o}
            return {"q_proj": (h, q, False), "kv_a_proj_with_mqa": kv_a, "kv_b_proj": kv_b, "o_proj": o}
        if self.fused_qkv:
            return {"qkv_proj": (h, q + 2 * k, self.qkv_bias), "o_proj": (q, h, self.o_bias)}
        return {"q_proj": (h, q, self.qkv_bias), "k_proj": (h, k, self.qkv_bias), "v_proj": (h, k, self.qkv_bias),
                "o_proj": (q, h, self.o_bias)}

    def mlp_linear_shapes(self, intermediate: int) -> dict[str, tuple[int, int, bool]]:
        """nn.Linear layers of a plain (gated) MLP of width ``intermediate``."""
        h, b = self.hidden_size, self.mlp_bias
        if self.fused_gate_up:
            return {"gate_up_proj": (h, 2 * intermediate, b), "down_proj": (intermediate, h, b)}
        return {"gate_proj": (h, intermediate, b), "up_proj": (h, intermediate, b), "down_proj": (intermediate, h, b)}

    def layer_linear_shapes(self, index: int | None = None) -> dict[str, tuple[int, int, bool]]:
        """Every nn.Linear of decoder layer ``index`` (the last by default) by name: attention and the plain MLP,
        or in an MoE layer the shared expert (the fused experts and the router are no nn.Linear)."""
        index = self.num_layers - 1 if index is None else index
        shapes = dict(self.attention_linear_shapes())
        if not self.is_moe_layer(index):
            return shapes | self.mlp_linear_shapes(self.intermediate_size)
        assert self.moe is not None
        if self.moe.shared_intermediate:
            shapes |= self.mlp_linear_shapes(self.moe.shared_intermediate)
        if self.moe.shared_gate:
            shapes["shared_expert_gate"] = (self.hidden_size, 1, False)
        return shapes

    def linear_shapes(self) -> dict[str, tuple[int, int, bool]]:
        """(in_features, out_features, has_bias) of each linear layer in a (the last) decoder layer."""
        return self.layer_linear_shapes()

    def linear_params(self, name: str, index: int | None = None) -> int:
        fan_in, fan_out, bias = self.layer_linear_shapes(index)[name]
        return fan_in * fan_out + (fan_out if bias else 0)

    def layer_linear_param_count(self, index: int) -> int:
        return sum(self.linear_params(name, index) for name in self.layer_linear_shapes(index))

    def layer_norm_params(self) -> int:
        """RMSNorm weights of one layer: around attention and MLP, per-head q/k norms, MLA's latent norms."""
        norms = self.norms_per_layer * self.hidden_size
        if self.qk_norm:
            norms += 2 * self.head_size
        if self.mla:
            norms += self.mla.q_lora_rank + self.mla.kv_lora_rank
        return norms

    def layer_expert_params(self, index: int, active: bool = False) -> int:
        """Fused expert weights and the router of layer ``index`` (all experts, or the top-k a token uses)."""
        if not self.is_moe_layer(index):
            return 0
        assert self.moe is not None
        experts = self.moe.top_k if active else self.moe.experts
        return experts * self.moe.expert_params(self.hidden_size) + self.moe.router_params(self.hidden_size)

    def layer_param_count(self, index: int, active: bool = False) -> int:
        sinks = self.num_heads if self.attention_sinks else 0
        return (self.layer_linear_param_count(index) + self.layer_norm_params() + sinks
                + self.layer_expert_params(index, active))

    @property
    def layer_linear_params(self) -> int:
        """nn.Linear parameters of the largest decoder layer."""
        return max(self.layer_linear_param_count(i) for i in self._layer_kinds())

    @property
    def layer_params(self) -> int:
        """The largest decoder layer (an MoE layer with all its experts): what FSDP gathers as one unit."""
        return max(self.layer_param_count(i) for i in self._layer_kinds())

    def _layer_kinds(self) -> tuple[int, ...]:
        """One representative layer index per kind (dense, MoE): all layers of a kind have the same size."""
        kinds = {self.is_moe_layer(i): i for i in range(self.num_layers)}
        return tuple(kinds.values())

    def layers_params(self, indices: range | list[int], active: bool = False) -> int:
        return sum(self.layer_param_count(i, active) for i in indices)

    @property
    def decoder_linear_params(self) -> int:
        """nn.Linear parameters of all decoder layers (what bitsandbytes quantizes; not the fused experts)."""
        return sum(self.layer_linear_param_count(i) for i in range(self.num_layers))

    @property
    def expert_params(self) -> int:
        """Fused expert weights and routers of all layers (0 for a dense model)."""
        return sum(self.layer_expert_params(i) for i in range(self.num_layers))

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The output projection (0 when it shares the embedding matrix; a reward model's score row has its own)."""
        if self.score_head:
            return self.hidden_size
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def language_params(self) -> int:
        """Embeddings + layers + final norm + output head (a tied head counted once), as transformers builds it."""
        return (self.embedding_params + self.layers_params(range(self.num_layers)) + self.hidden_size
                + self.head_params)

    @property
    def vision_params(self) -> int:
        """An image-text checkpoint's vision tower and projector (0 for a text model)."""
        return self.vision.total_params if self.vision else 0

    @property
    def total_params(self) -> int:
        """Every weight the model holds: the language model, and an image-text checkpoint's tower and projector."""
        return self.language_params + self.vision_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: every expert layer counts its top-k experts, the router and the
        shared experts. The embedding counts (as Mixtral's 12.9B and DeepSeek-V3's 37B do)."""
        return (self.embedding_params + self.layers_params(range(self.num_layers), active=True) + self.hidden_size
                + self.head_params + self.vision_params)

    @property
    def counts_checked(self) -> bool:
        """Whether this family's parameter counts were checked against transformers (see CHECKED_MODEL_TYPES)."""
        return self.model_type in CHECKED_MODEL_TYPES

    @property
    def checkpoint_copy_bytes(self) -> int:
        """One copy of the weights as the checkpoint stores them."""
        return self.total_params * self.checkpoint_bytes

    @property
    def largest_load_unit(self) -> int:
        """Parameters of the biggest piece a sharded load gathers at once: one decoder layer or the embedding."""
        return max(self.layer_params, self.embedding_params)

    @property
    def linear_module_names(self) -> tuple[str, ...]:
        """Every nn.Linear name in the decoder layers (what lora_target 'all' adapts, as peft's all-linear)."""
        names: dict[str, None] = {}
        for i in self._layer_kinds():
            names |= dict.fromkeys(self.layer_linear_shapes(i))
        return tuple(names)


# --- reading config.json ---

def shape_from_config(data: dict, source: str = "") -> ModelShape:
    """A ModelShape from a Hugging Face config.json mapping (LLaMA names; GPT-2 style aliases accepted).

    Families beyond LLaMA are recognised by ``model_type`` and by their own keys: experts (num_experts,
    num_local_experts, n_routed_experts), latent attention (kv_lora_rank), local/global layers (layer_types).
    """
    config = data.get("text_config") or data  # multimodal wrappers keep the decoder under text_config
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        raise ConfigError(f"model config {source or '(mapping)'} lacks {', '.join(missing)}: the estimate "
                          "needs a LLaMA-style config.json; pass --model-config PATH to one")
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_key_value_heads",
             "intermediate_size", "head_dim")
    unusable = [f"{key} ({config[key]!r})" for key in sizes if config.get(key) is not None
                and not (isinstance(config[key], int) and not isinstance(config[key], bool) and config[key] >= 1)]
    if unusable:
        what = "whole numbers" if len(unusable) > 1 else "a whole number"
        raise ConfigError(f"model config {source or '(mapping)'}: {', '.join(unusable)} must be {what} of at least "
                          "1; the config.json is damaged: save or download the model again")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    layers = int(config["num_hidden_layers"])
    model_type = str(config.get("model_type", "llama"))
    attention_bias = bool(config.get("attention_bias", False))
    tie_default = model_type in TIED_BY_DEFAULT_MODEL_TYPES
    # An image-text wrapper's own flag ties its output layer (transformers 5), whatever text_config says.
    tied = data.get("tie_word_embeddings") if config is not data else None
    window, sliding = sliding_layers_from_config(config, model_type, layers)
    return ModelShape(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
        vocab_size=int(config["vocab_size"]),
        tie_word_embeddings=bool(tied if tied is not None else
                                 config.get("tie_word_embeddings", data.get("tie_word_embeddings", tie_default))),
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        qkv_bias=attention_bias or model_type in QKV_BIAS_MODEL_TYPES,
        o_bias=attention_bias and model_type not in NO_O_BIAS_MODEL_TYPES,
        mlp_bias=bool(config.get("mlp_bias", False)),
        model_type=model_type,
        source=source,
        checkpoint_bytes=checkpoint_dtype_bytes(config, data),
        norms_per_layer=4 if model_type in FOUR_NORM_MODEL_TYPES else 2,
        qk_norm=model_type in QK_NORM_MODEL_TYPES,
        fused_qkv=model_type in FUSED_QKV_MODEL_TYPES,
        fused_gate_up=model_type in FUSED_GATE_UP_MODEL_TYPES,
        attention_sinks=model_type in SINK_MODEL_TYPES,
        attn_softcapping=bool(config.get("attn_logit_softcapping")),
        moe=moe_from_config(config, model_type, layers),
        mla=mla_from_config(config),
        sliding_window=window,
        sliding_layers=sliding,
        vision=vision_from_config(data),
    )


def moe_from_config(config: dict, model_type: str, layers: int) -> MoeShape | None:
    """The experts of Mixtral/GPT-OSS (num_local_experts), Qwen-MoE (num_experts) and DeepSeek (n_routed_experts)."""
    experts = expert_count(config)
    if experts <= 1:
        return None
    top_k = int(config.get("num_experts_per_tok") or config.get("experts_per_token") or 2)
    expert_i = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    shared = int(config.get("n_shared_experts") or 0) * expert_i
    shared = shared or int(config.get("shared_expert_intermediate_size") or 0)
    if "first_k_dense_replace" in config:  # DeepSeek: the first k layers keep a plain MLP
        dense = tuple(range(min(int(config["first_k_dense_replace"] or 0), layers)))
    else:  # Qwen-MoE: mlp_only_layers, and only every decoder_sparse_step-th layer is sparse
        step = int(config.get("decoder_sparse_step") or 1)
        only = set(config.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    return MoeShape(experts=experts, top_k=top_k, expert_intermediate=expert_i, shared_intermediate=shared,
                    shared_gate=model_type == "qwen2_moe" and shared > 0, router_bias=model_type == "gpt_oss",
                    expert_bias=model_type == "gpt_oss", dense_layers=dense,
                    aux_loss="router_aux_loss_coef" in config, clamped_swiglu=model_type == "gpt_oss")


def mla_from_config(config: dict) -> MlaShape | None:
    """DeepSeek-V2/V3 latent attention, present when config.json has kv_lora_rank."""
    if not config.get("kv_lora_rank"):
        return None
    return MlaShape(q_lora_rank=int(config.get("q_lora_rank") or 0), kv_lora_rank=int(config["kv_lora_rank"]),
                    qk_rope_head_dim=int(config["qk_rope_head_dim"]), qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                    v_head_dim=int(config["v_head_dim"]))


def sliding_layers_from_config(config: dict, model_type: str, layers: int) -> tuple[int | None, int]:
    """(window, layers that use it): layer_types when given, else the family's pattern (Gemma 2 alternates,
    Gemma 3 has sliding_window_pattern - 1 local layers per global one), else every layer when a window is set
    (Mistral, Phi-3; Qwen only with use_sliding_window)."""
    window = config.get("sliding_window")
    if not window or (model_type.startswith("qwen") and not config.get("use_sliding_window", False)):
        return None, 0
    types = config.get("layer_types")
    if types:
        return int(window), sum(1 for t in types[:layers] if t == "sliding_attention")
    if model_type == "gemma2":
        return int(window), sum(1 for i in range(layers) if i % 2 == 0)
    pattern = int(config.get("sliding_window_pattern") or 0)
    if pattern > 1:
        return int(window), sum(1 for i in range(layers) if (i + 1) % pattern != 0)
    return int(window), layers


def checkpoint_dtype_bytes(config: dict, data: dict) -> int:
    """Bytes per weight in the checkpoint: config.json's ``dtype`` (``torch_dtype`` before transformers 5)."""
    names = [d.get(key) for d in (config, data) for key in ("dtype", "torch_dtype")]
    dtype = next((str(n) for n in names if n), "float32")
    return CHECKPOINT_DTYPE_BYTES.get(dtype.removeprefix("torch."), 4)


def load_model_shape(model: str | None, model_config: str | None = None) -> ModelShape:
    """The shape of ``model``: --model-config, the local folder, the Hugging Face cache, or a known hub id.

    Never downloads: a hub id is resolved only from what this machine already has.
    """
    if model_config:
        return shape_from_config(_read_json(_config_json_path(Path(model_config))), model_config)
    if not model:
        raise ConfigError("model_name_or_path is not set: the estimate needs the model's config.json")
    try:
        found = model_config_json(model)
    except ModelError as err:
        raise ConfigError(f"{err.problems[0]}; pass --model-config PATH") from None
    if found is not None:
        return shape_from_config(found, f"{model} (config.json)")
    known = KNOWN_CONFIGS.get(model.lower())
    if known is not None:
        return shape_from_config(known, f"{model} (built-in shape)")
    raise ConfigError(f"model_name_or_path ({model}): no config.json here or in the Hugging Face cache; "
                      "pass --model-config PATH (a config.json or the folder holding it)")


def _config_json_path(path: Path) -> Path:
    candidate = path / "config.json" if path.is_dir() else path
    if not candidate.is_file():
        raise ConfigError(f"--model-config ({path}): no such config.json file or folder holding one")
    return candidate


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"model config {path}: cannot read it as JSON ({err}); pass --model-config PATH") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model config {path}: expected a JSON object")
    return data


# Shapes of a few hub models the shipped examples name, copied from their config.json, so that the examples
# can be estimated on a machine that never downloaded them.
_LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
_LLAMA3_70B = {
    "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
KNOWN_CONFIGS: dict[str, dict] = {
    "meta-llama/meta-llama-3-8b": _LLAMA3_8B,
    "meta-llama/meta-llama-3-8b-instruct": _LLAMA3_8B,
    "meta-llama/llama-3.1-8b": _LLAMA3_8B,
    "meta-llama/llama-3.1-8b-instruct": _LLAMA3_8B,
    "meta-llama/meta-llama-3-70b": _LLAMA3_70B,
    "meta-llama/meta-llama-3-70b-instruct": _LLAMA3_70B,
    "meta-llama/llama-3.1-70b": _LLAMA3_70B,
    "meta-llama/llama-3.1-70b-instruct": _LLAMA3_70B,
}
