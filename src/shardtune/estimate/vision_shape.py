"""The vision tower and projector of an image-text checkpoint, read from config.json's ``vision_config``.

The one owner of the tower's shape for the estimate: its parameters (by part, as model/composite.py splits them:
the tower, and the projector that maps its features into the language model, Qwen's mergers included), its Linear
layers (what LoRA can adapt when a part is not frozen), and how many patches and tokens an image becomes. Only
json is read, like shape.py. Counts were checked equal to the models transformers builds
(tests/unit/test_estimate_vision.py), at tiny sizes and at each family's default sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# vision_config.model_type -> the tower's layout. Qwen3-VL(-MoE) and Qwen3.5(-MoE) share one tower (Qwen3-VL adds
# deepstack mergers); Gemma 3's is SigLIP; Mistral 3's is Pixtral.
TOWER_FAMILIES = {
    "qwen2_vl_vision": "qwen2_vl",
    "qwen2_5_vl_vision": "qwen2_5_vl",
    "qwen3_vl_vision": "qwen3_vl",
    "qwen3_vl_moe_vision": "qwen3_vl",
    "qwen3_5_vision": "qwen3_vl",
    "qwen3_5_moe_vision": "qwen3_vl",
    "siglip_vision_model": "siglip",
    "gemma4_vision": "gemma4",
    "pixtral": "pixtral",
}
# Towers whose MLP is gated (gate, up, down) rather than two layers around an activation.
GATED_MLP_FAMILIES = frozenset({"qwen2_5_vl", "gemma4", "pixtral"})
# Qwen's image processor merges merge x merge patches into one token and cuts images into patches of
# temporal_patch_size frames (a still image is repeated).
QWEN_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})

Linear = tuple[str, int, int, bool, int]  # short name, in_features, out_features, has bias, how many


@dataclass(frozen=True)
class VisionShape:
    """What the memory model needs to know about a vision tower and its projector."""

    family: str  # a value of TOWER_FAMILIES
    model_type: str  # vision_config's
    width: int  # the tower's hidden size
    depth: int  # its blocks
    heads: int
    intermediate: int
    patch_size: int
    text_hidden: int  # the language model's hidden size (the projector's output)
    channels: int = 3
    temporal_patch: int = 1  # frames per patch (Qwen: 2)
    merge: int = 1  # merge x merge patches make one token (Qwen's merger, Mistral 3's patch merger)
    merger_out: int = 0  # Qwen's merger output width (out_hidden_size; Qwen2-VL's hidden_size)
    positions: int = 0  # rows of a learned position table (Qwen3-VL, SigLIP; Gemma 4: per axis)
    deepstack: int = 0  # Qwen3-VL: mergers that feed features of inner blocks to the first decoder layers
    deepstack_run: int = 0  # those whose block exists (a tower shallower than its indexes builds them unused)
    pooled_head: bool = False  # SigLIP's attention-pooling head (vision_use_head)
    kv_heads: int = 0  # Gemma 4: grouped attention in the tower
    head_dim: int = 0
    feature_layers: int = 1  # Mistral 3: tower layers whose features are concatenated (vision_feature_layer)
    projector_bias: bool = False  # Mistral 3: multimodal_projector_bias
    fixed_tokens: int = 0  # Gemma 3: mm_tokens_per_image, whatever the image's size

    @property
    def is_gated(self) -> bool:
        return self.family in GATED_MLP_FAMILIES

    @property
    def merged_width(self) -> int:
        """Width of merge x merge patches side by side: what Qwen's merger (and Mistral 3's) reads per token."""
        return self.width * self.merge**2

    # --- Linear layers by part ---

    def tower_linears(self) -> list[Linear]:
        """Every nn.Linear of the tower (outside the projector), with how many of each."""
        w, i, n = self.width, self.intermediate, self.depth
        if self.family in QWEN_FAMILIES:
            mlp = (("gate_proj", w, i), ("up_proj", w, i), ("down_proj", i, w)) if self.is_gated else \
                (("fc1", w, i), ("fc2", i, w)) if self.family == "qwen2_vl" else \
                (("linear_fc1", w, i), ("linear_fc2", i, w))
            return [("qkv", w, 3 * w, True, n), ("proj", w, w, True, n), *((m, a, b, True, n) for m, a, b in mlp)]
        if self.family == "siglip":
            head = 1 if self.pooled_head else 0
            return [("q_proj", w, w, True, n), ("k_proj", w, w, True, n), ("v_proj", w, w, True, n),
                    ("out_proj", w, w, True, n + head), ("fc1", w, i, True, n + head), ("fc2", i, w, True, n + head)]
        if self.family == "gemma4":  # every Linear sits inside a clippable wrapper, as its child "linear"
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            return [("input_proj", self.channels * self.patch_size**2, w, False, 1),
                    *(("linear", a, b, False, n) for a, b in ((w, q), (w, kv), (w, kv), (q, w), (w, i), (w, i),
                                                              (i, w)))]
        return [(name, w, w, False, n) for name in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
            [("gate_proj", w, i, False, n), ("up_proj", w, i, False, n), ("down_proj", i, w, False, n)]  # pixtral

    def projector_linears(self) -> list[Linear]:
        """Every nn.Linear of the projector (Gemma 3's is a bare matrix, no Linear)."""
        m, mergers = self.merged_width, 1 + self.deepstack
        if self.family == "qwen2_vl" or self.family == "qwen2_5_vl":
            return [("0", m, m, True, 1), ("2", m, self.merger_out, True, 1)]
        if self.family == "qwen3_vl":
            return [("linear_fc1", m, m, True, mergers), ("linear_fc2", m, self.merger_out, True, mergers)]
        if self.family == "gemma4":
            return [("embedding_projection", self.width, self.text_hidden, False, 1)]
        if self.family == "pixtral":
            b = self.projector_bias
            return [("merging_layer", m, self.width, False, 1),
                    ("linear_1", self.width * self.feature_layers, self.text_hidden, b, 1),
                    ("linear_2", self.text_hidden, self.text_hidden, b, 1)]
        return []

    # --- parameters ---

    @property
    def tower_params(self) -> int:
        """Parameters of the tower: patch embedding, positions, blocks (Linear layers and norms), final norm, head."""
        return _linear_params(self.tower_linears()) + self._tower_other_params()

    @property
    def projector_params(self) -> int:
        """Parameters of the projector (Qwen's mergers, Gemma 3's projection and norm, Mistral 3's)."""
        return _linear_params(self.projector_linears()) + self._projector_other_params()

    @property
    def total_params(self) -> int:
        return self.tower_params + self.projector_params

    @property
    def block_params(self) -> int:
        """One tower block: what FSDP wraps as a unit (the rest of the tower stays in the root unit)."""
        linears = [(name, a, b, bias, 1) for name, a, b, bias, count in self.tower_linears() if count >= self.depth]
        return _linear_params(linears) + self._block_norm_params()

    @property
    def unwrapped_params(self) -> int:
        """Everything outside the tower's blocks (patch embedding, positions, mergers): FSDP's root unit holds it."""
        return self.total_params - self.depth * self.block_params

    def _block_norm_params(self) -> int:
        w = self.width
        if self.family == "qwen2_5_vl" or self.family == "pixtral":
            return 2 * w  # two RMSNorms
        if self.family == "gemma4":
            return 4 * w + 2 * self.head_dim  # four RMSNorms and the per-head q/k norms
        return 4 * w  # two LayerNorms, weight and bias

    def _tower_other_params(self) -> int:
        w, c, p = self.width, self.channels, self.patch_size
        norms = self.depth * self._block_norm_params()
        if self.family in QWEN_FAMILIES:  # a Conv3d over (temporal_patch, p, p); Qwen3-VL's has a bias
            bias = w if self.family == "qwen3_vl" else 0
            return w * c * self.temporal_patch * p * p + bias + self.positions * w + norms
        if self.family == "siglip":  # Conv2d with bias, positions, post-layernorm; the head's probe, in_proj, norm
            head = w + 3 * w * w + 3 * w + 2 * w if self.pooled_head else 0
            return w * c * p * p + w + self.positions * w + norms + 2 * w + head
        if self.family == "gemma4":
            return 2 * self.positions * w + norms
        return w * c * p * p + w + norms  # pixtral: Conv2d without bias, ln_pre

    def _projector_other_params(self) -> int:
        w, mergers = self.width, 1 + self.deepstack
        if self.family == "qwen2_vl":
            return 2 * w  # ln_q, a LayerNorm
        if self.family == "qwen2_5_vl":
            return w  # ln_q, an RMSNorm
        if self.family == "qwen3_vl":  # the merger's LayerNorm over w, each deepstack merger's over merge^2 * w
            return 2 * w + (mergers - 1) * 2 * self.merged_width
        if self.family == "siglip":
            return w * self.text_hidden + w  # mm_input_projection_weight, mm_soft_emb_norm
        if self.family == "pixtral":
            return w  # the projector's RMSNorm
        return 0

    # --- images ---

    def patches_per_image(self, max_pixels: int) -> int:
        """The most patches an image becomes when the processor scales it to at most ``max_pixels``: sides that
        are multiples of patch x merge (Qwen), or the fixed input size (Gemma 3's SigLIP)."""
        if self.family == "siglip":
            return self.positions
        unit = self.patch_size * self.merge
        return max(1, max_pixels // unit**2) * self.merge**2

    def tokens_per_image(self, max_pixels: int) -> int:
        """Tokens of the language model's sequence that stand for one image (Qwen: one per merged patch)."""
        if self.fixed_tokens:
            return self.fixed_tokens
        return self.patches_per_image(max_pixels) // self.merge**2

    @property
    def patch_values(self) -> int:
        """Pixel values per patch in the model's input (channels x frames x patch_size^2)."""
        return self.channels * self.temporal_patch * self.patch_size**2


def _linear_params(linears: list[Linear]) -> int:
    return sum(count * (a * b + (b if bias else 0)) for _, a, b, bias, count in linears)


def vision_from_config(data: dict) -> VisionShape | None:
    """The vision tower of an image-text config.json (None: no tower, or one the estimate does not know)."""
    vision = data.get("vision_config")
    if not isinstance(vision, dict):
        return None
    family = TOWER_FAMILIES.get(str(vision.get("model_type")))
    text = data.get("text_config") or {}
    if family is None or "hidden_size" not in text:
        return None
    channels = vision.get("in_channels") or vision.get("in_chans") or vision.get("num_channels") or 3
    base = VisionShape(family=family, model_type=str(vision["model_type"]), width=0, depth=0, heads=0,
                       intermediate=0, patch_size=int(vision["patch_size"]), text_hidden=int(text["hidden_size"]),
                       channels=int(channels))
    if family in QWEN_FAMILIES:
        return _qwen_tower(vision, base)
    base = replace(base, width=int(vision["hidden_size"]), depth=int(vision["num_hidden_layers"]),
                   heads=int(vision["num_attention_heads"]), intermediate=int(vision["intermediate_size"]))
    if family == "siglip":
        side = int(vision["image_size"]) // base.patch_size
        return replace(base, positions=side * side, pooled_head=bool(vision.get("vision_use_head", True)),
                       fixed_tokens=int(data.get("mm_tokens_per_image") or 256))
    if family == "gemma4":
        return replace(base, positions=int(vision["position_embedding_size"]),
                       kv_heads=int(vision.get("num_key_value_heads") or base.heads),
                       head_dim=int(vision.get("head_dim") or base.width // base.heads))
    layer = data.get("vision_feature_layer", -1)
    return replace(base, merge=int(data.get("spatial_merge_size") or 2),
                   feature_layers=len(layer) if isinstance(layer, list) else 1,
                   projector_bias=bool(data.get("multimodal_projector_bias", False)))


def _qwen_tower(vision: dict, base: VisionShape) -> VisionShape:
    """Qwen2-VL names its tower width embed_dim (hidden_size is the merger's output); the later ones hidden_size,
    with out_hidden_size for the merger."""
    if base.family == "qwen2_vl":
        width = int(vision["embed_dim"])
        intermediate, out = int(width * float(vision.get("mlp_ratio", 4))), int(vision["hidden_size"])
    else:
        width, intermediate = int(vision["hidden_size"]), int(vision["intermediate_size"])
        out = int(vision["out_hidden_size"])
    positions = int(vision.get("num_position_embeddings") or 0) if base.family == "qwen3_vl" else 0
    depth, deepstack = int(vision["depth"]), list(vision.get("deepstack_visual_indexes") or [])
    return replace(base, width=width, depth=depth, heads=int(vision["num_heads"]),
                   intermediate=intermediate, temporal_patch=int(vision.get("temporal_patch_size") or 2),
                   merge=int(vision.get("spatial_merge_size") or 2), merger_out=out, positions=positions,
                   deepstack=len(deepstack), deepstack_run=sum(1 for index in deepstack if index < depth))
