"""The shape of a LLaMA-style decoder read from its config.json, and exact parameter counts.

Only json is used (no transformers import): `shardtune estimate` and `shardtune check` must stay fast and
must work for models whose weights are not on this machine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from shardtune.errors import ConfigError

# Linear layers of one decoder layer, by the names LoRA's lora_target uses.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES

# Model types whose q/k/v projections always carry a bias, whatever `attention_bias` says.
QKV_BIAS_MODEL_TYPES = frozenset({"qwen2"})
# Checkpoint dtypes by their config.json name; anything else counts as 4 bytes (an upper bound).
CHECKPOINT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_size

    def linear_shapes(self) -> dict[str, tuple[int, int, bool]]:
        """(in_features, out_features, has_bias) of each linear layer in one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_width, self.qkv_bias),
            "k_proj": (h, self.kv_width, self.qkv_bias),
            "v_proj": (h, self.kv_width, self.qkv_bias),
            "o_proj": (self.q_width, h, self.o_bias),
            "gate_proj": (h, i, self.mlp_bias),
            "up_proj": (h, i, self.mlp_bias),
            "down_proj": (i, h, self.mlp_bias),
        }

    def linear_params(self, name: str) -> int:
        fan_in, fan_out, bias = self.linear_shapes()[name]
        return fan_in * fan_out + (fan_out if bias else 0)

    @property
    def layer_linear_params(self) -> int:
        return sum(self.linear_params(name) for name in LINEAR_MODULES)

    @property
    def layer_params(self) -> int:
        """One decoder layer: seven linear layers and two RMSNorm weights."""
        return self.layer_linear_params + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The output projection (0 when it shares the embedding matrix)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Embeddings + layers + final norm + output head: exact for LLaMA, Mistral and Qwen2 decoders."""
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + self.head_params

    @property
    def checkpoint_copy_bytes(self) -> int:
        """One copy of the weights as the checkpoint stores them."""
        return self.total_params * self.checkpoint_bytes

    @property
    def largest_load_unit(self) -> int:
        """Parameters of the biggest piece a sharded load gathers at once: one decoder layer or the embedding."""
        return max(self.layer_params, self.embedding_params)


def lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...] | list[str]) -> int:
    """Trainable LoRA parameters: r x (in + out) per adapted linear layer (A is r x in, B is out x r)."""
    modules = lora_target_modules(targets)
    per_layer = sum(rank * (shape.linear_shapes()[m][0] + shape.linear_shapes()[m][1]) for m in modules)
    return shape.num_layers * per_layer


def lora_target_modules(targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """'all' means every linear layer of the decoder (never the output head), as peft's 'all-linear'."""
    names = [t.strip() for t in targets if t.strip()]
    if "all" in names:
        return LINEAR_MODULES
    unknown = [t for t in names if t not in LINEAR_MODULES]
    if unknown:
        raise ConfigError(f"lora_target ({','.join(unknown)}): the estimate knows the LLaMA module names "
                          f"{','.join(LINEAR_MODULES)}; use those or 'all'")
    return tuple(names)


def freeze_trainable_params(shape: ModelShape, layers: int, modules: tuple[str, ...] | list[str]) -> int:
    """Parameters of the |layers| trainable decoder layers (restricted to ``modules`` unless 'all')."""
    count = min(abs(layers), shape.num_layers)
    names = [m.strip() for m in modules if m.strip()]
    if "all" in names:
        return count * shape.layer_params
    per_layer = 0
    for name in names:
        if name in LINEAR_MODULES:
            per_layer += shape.linear_params(name)
        elif name == "self_attn":
            per_layer += sum(shape.linear_params(m) for m in ATTENTION_MODULES)
        elif name == "mlp":
            per_layer += sum(shape.linear_params(m) for m in MLP_MODULES)
        elif name in ("input_layernorm", "post_attention_layernorm"):
            per_layer += shape.hidden_size
    return count * per_layer


# --- reading config.json ---

def shape_from_config(data: dict, source: str = "") -> ModelShape:
    """A ModelShape from a Hugging Face config.json mapping (LLaMA names; GPT-2 style aliases accepted)."""
    config = data.get("text_config") or data  # multimodal wrappers keep the decoder under text_config
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        raise ConfigError(f"model config {source or '(mapping)'} lacks {', '.join(missing)}: the estimate "
                          "needs a LLaMA-style config.json; pass --model-config PATH to one")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    model_type = str(config.get("model_type", "llama"))
    attention_bias = bool(config.get("attention_bias", False))
    return ModelShape(
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
        vocab_size=int(config["vocab_size"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", data.get("tie_word_embeddings", False))),
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        qkv_bias=attention_bias or model_type in QKV_BIAS_MODEL_TYPES,
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        model_type=model_type,
        source=source,
        checkpoint_bytes=checkpoint_dtype_bytes(config, data),
    )


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
    local = Path(model).expanduser() / "config.json"
    if local.is_file():
        return shape_from_config(_read_json(local), str(local))
    cached = hub_cache_config(model)
    if cached is not None:
        return shape_from_config(_read_json(cached), str(cached))
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


def hub_cache_config(model_id: str) -> Path | None:
    """config.json of a hub id already in the Hugging Face cache (newest snapshot), without huggingface_hub."""
    if "/" not in model_id or model_id.startswith((".", "/", "~")):
        return None
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    snapshots = Path(cache) / f"models--{model_id.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


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
