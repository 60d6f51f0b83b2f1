"""What is trained and how: the inputs of the memory model besides the model shape and the hardware."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.schema import TrainConfig
from shardtune.estimate.adapter_shape import (
    adapted_widths,
    freeze_trainable_params,
    lora_params,
    lora_target_modules,
    oft_params,
)
from shardtune.estimate.shape import ModelShape
from shardtune.estimate.vision_shape import Linear
from shardtune.model.finetuning.oft import OftSettings
from shardtune.model.finetuning.oft import trainable_params as oft_layer_params
from shardtune.model.finetuning.settings import FrozenParts

PRECISIONS = ("fp32", "bf16", "fp16")
FINETUNING_TYPES = ("full", "freeze", "lora", "qlora", "oft")

# Optimizer state bytes per trainable parameter (all fp32 unless noted).
OPTIMIZER_STATE_BYTES = {
    "adamw_torch": 8,  # exp_avg + exp_avg_sq
    "adamw_torch_fused": 8,
    "adamw_8bit": 2,  # two 8-bit states (block constants are negligible)
    # Paged (CUDA unified memory): counted on the device, where the state stays until the device runs short.
    "paged_adamw_8bit": 2,
    "paged_adamw_32bit": 8,
    "sgd": 0,  # shardtune's SGD has no momentum buffer
    "adafactor": 0,  # factored second moment: rows + columns per matrix, negligible next to the weights
}

# 4-bit NF4 with double quantization: 4 bits per weight + 8-bit absmax per 64 weights + fp32 per 256 blocks.
NF4_BYTES_PER_PARAM = 0.5 + (8 / 64 + 32 / (64 * 256)) / 8
# LLM.int8: one byte per weight + an fp32 scale per output row (negligible).
INT8_BYTES_PER_PARAM = 1.0


@dataclass(frozen=True)
class Workload:
    """Per-device batch geometry, precision and fine-tuning method."""

    micro_batch: int
    seq_len: int
    precision: str = "fp32"
    finetuning_type: str = "full"
    gradient_checkpointing: bool = False
    lora_rank: int = 8
    use_dora: bool = False
    lora_targets: tuple[str, ...] = ("all",)  # the adapter's targets (oft_target under OFT)
    oft: OftSettings = OftSettings()
    freeze_trainable_layers: int = 2
    freeze_trainable_modules: tuple[str, ...] = ("all",)
    quantization_bit: int | None = None
    attn_implementation: str = "sdpa"
    optim: str = "adamw_torch_fused"
    gradient_accumulation_steps: int = 1
    loss_chunk_size: int = TrainConfig.loss_chunk_size  # 0: the loss takes the full [tokens, vocab] logits
    # Preference stages: rows per sample in one forward (dpo: chosen + rejected; kto: the answer + its KL row).
    rows_per_sample: int = 1
    # dpo/kto full/freeze with a live reference: a frozen copy of the weights, placed as the policy's weights.
    reference_copy: bool = False
    # sequence_parallel_size: ranks that split each row (each computes seq_len / N of its tokens); the mode as
    # configured (auto: ulysses where the heads divide, see engines/sequence_parallel_plan.py).
    sequence_parallel: int = 1
    sequence_parallel_mode: str = "auto"
    # expert_parallel_size: ranks that split each MoE layer's experts (FSDP2 only; estimate/expert_parallel.py).
    expert_parallel: int = 1
    # Whether rows carry a [S, S] attention mask (padded or packed sft rows); pt's packing concatenates texts into
    # full rows that need none (data/processing.py), and causal attention then builds no mask.
    dense_mask: bool = True
    # Image-text models: LLaMA-Factory's freeze_* keys (model/composite.py), and the images of a sample: the data's
    # images column read as this many images per sample, each at most image_max_pixels (0: the tower never runs).
    frozen_parts: FrozenParts = FrozenParts()
    images_per_sample: int = 0
    image_max_pixels: int = 768 * 768
    # async_save: each rank holds one staged copy of what it writes in a checkpoint in host memory until it is
    # written (engines/checkpoint_writer.py).
    async_save: bool = False
    # Stage grpo (0 for the other stages): max_completion_length, the generated part of each row. A micro-batch is
    # then one group, the num_generations rows that generate and train together (train/grpo_step.py: one forward
    # and backward per group), each row a prompt and its completion within seq_len (cutoff_len: data/rl_prompts.py
    # refuses a prompt longer than cutoff_len - max_completion_length).
    completion_tokens: int = 0
    # rollout_backend vllm_protocol_cpu: a generator process on rank 0's node generates with its own copy of the
    # weights (train/protocol_generator.py), so the ranks hold no rollout of their own.
    external_generator: bool = False

    @property
    def is_grpo(self) -> bool:
        return self.completion_tokens > 0

    @property
    def local_seq_len(self) -> int:
        """Tokens of a row this rank computes: all of them, or its slice of a split row (rows are padded to a
        multiple of the split)."""
        return -(-self.seq_len // self.sequence_parallel)

    @property
    def tokens(self) -> int:
        """Tokens this rank computes per micro-batch (its slices under sequence parallelism)."""
        return self.micro_batch * self.rows_per_sample * self.local_seq_len

    @property
    def splits_sequences(self) -> bool:
        return self.sequence_parallel > 1

    @property
    def is_loss_chunked(self) -> bool:
        return self.loss_chunk_size > 0

    @property
    def mixed_precision(self) -> bool:
        return self.precision != "fp32"

    @property
    def compute_bytes(self) -> int:
        """Bytes of one activation element in the matmuls: 2 under bf16/fp16, else 4."""
        return 2 if self.mixed_precision else 4

    @property
    def is_lora(self) -> bool:
        return self.finetuning_type in ("lora", "qlora")

    @property
    def is_adapter(self) -> bool:
        """A peft adapter trains over frozen base weights (LoRA, QLoRA or OFT)."""
        return self.is_lora or self.finetuning_type == "oft"

    @property
    def optimizer_state_bytes(self) -> int:
        return OPTIMIZER_STATE_BYTES.get(self.optim, 8)


def trainable_params(shape: ModelShape, w: Workload) -> int:
    """Parameters that get gradients and optimizer states (a reward model's score row trains under every
    method). An image-text model's frozen parts (freeze_* keys) train under no method; freeze tuning trains
    decoder layers of the language model only."""
    score = shape.head_params if shape.score_head else 0
    if w.is_adapter:
        return adapter_params(shape, w) + score
    if w.finetuning_type == "freeze":
        if w.frozen_parts.language_model:
            return 0
        return freeze_trainable_params(shape, w.freeze_trainable_layers, w.freeze_trainable_modules) + score
    return language_trained(shape, w) * shape.language_params + fully_trained_vision_params(shape, w)


def language_trained(shape: ModelShape, w: Workload) -> bool:
    """Whether the language model trains: always, but for an image-text model under freeze_language_model."""
    return shape.vision is None or not w.frozen_parts.language_model


def fully_trained_vision_params(shape: ModelShape, w: Workload) -> int:
    """Tower and projector parameters full fine-tuning trains (the parts not frozen)."""
    v, frozen = shape.vision, w.frozen_parts
    if v is None or w.finetuning_type != "full":
        return 0
    return (0 if frozen.vision_tower else v.tower_params) + (0 if frozen.multi_modal_projector else v.projector_params)


def tower_trains(shape: ModelShape, w: Workload) -> bool:
    """Whether the vision tower has trainable parameters (full fine-tuning, or an adapter on its Linear layers)."""
    if shape.vision is None or w.frozen_parts.vision_tower:
        return False
    return w.finetuning_type == "full" or (w.is_adapter and bool(adapted_vision_linears(shape, w, "tower")))


def projector_trains(shape: ModelShape, w: Workload) -> bool:
    """Whether the projector has trainable parameters."""
    if shape.vision is None or w.frozen_parts.multi_modal_projector:
        return False
    return w.finetuning_type == "full" or (w.is_adapter and bool(adapted_vision_linears(shape, w, "projector")))


def adapted_vision_linears(shape: ModelShape, w: Workload, part: str) -> list[Linear]:
    """The Linear layers of the tower or the projector an adapter wraps: none of a frozen part (peft's
    exclude_modules); of a part that is not, every one for 'all' (peft's all-linear), else those named in the
    targets."""
    v = shape.vision
    frozen = w.frozen_parts.vision_tower if part == "tower" else w.frozen_parts.multi_modal_projector
    if v is None or frozen or not w.is_adapter:
        return []
    linears = v.tower_linears() if part == "tower" else v.projector_linears()
    names = {t.strip() for t in w.lora_targets}
    return [linear for linear in linears if "all" in names or linear[0] in names]


def grad_path_layers(shape: ModelShape, w: Workload) -> int:
    """Decoder layers the backward pass runs through (and that therefore keep activations).

    Freezing the last N layers stops the backward after them; freezing all but the first N does not.
    """
    if w.finetuning_type == "freeze" and w.freeze_trainable_layers > 0:
        return min(w.freeze_trainable_layers, shape.num_layers)
    return shape.num_layers


def grad_path_indices(shape: ModelShape, w: Workload) -> range:
    """The decoder layers the backward runs through: the last ``grad_path_layers``."""
    return range(shape.num_layers - grad_path_layers(shape, w), shape.num_layers)


def quantized_linear_params(shape: ModelShape, w: Workload) -> int:
    """Base linear weights stored by bitsandbytes (QLoRA); 0 without quantization. bitsandbytes replaces
    nn.Linear layers only: fused MoE experts stay in the module dtype."""
    if w.quantization_bit is None:
        return 0
    return shape.decoder_linear_params


def weight_bytes(shape: ModelShape, w: Workload, module_bytes: int) -> float:
    """Bytes of all weights as the engine holds them: ``module_bytes`` each, quantized linears less.

    LoRA adapters are counted at ``module_bytes`` too (peft creates them in the module's dtype; under QLoRA
    prepare_model_for_kbit_training upcasts everything that is not quantized to fp32).
    """
    quantized = quantized_linear_params(shape, w)
    per_quantized = NF4_BYTES_PER_PARAM if w.quantization_bit == 4 else INT8_BYTES_PER_PARAM
    adapters = adapter_params(shape, w) if w.is_adapter else 0
    plain = shape.total_params - quantized + adapters
    return plain * module_bytes + quantized * per_quantized


def adapter_params(shape: ModelShape, w: Workload) -> int:
    """Trainable parameters of the adapter: LoRA's two matrices or OFT's rotation blocks per adapted layer (of the
    language model unless freeze_language_model, and of an image-text model's parts that are not frozen)."""
    vision = [linear for part in ("tower", "projector") for linear in adapted_vision_linears(shape, w, part)]
    if w.finetuning_type == "oft":
        language = oft_params(shape, w.oft, w.lora_targets) if language_trained(shape, w) else 0
        return language + sum(count * oft_layer_params(a, w.oft) for _, a, _, _, count in vision)
    language = lora_params(shape, w.lora_rank, w.lora_targets) if language_trained(shape, w) else 0
    return language + sum(count * w.lora_rank * (a + b) for _, a, b, _, count in vision)


def adapter_activation_width(w: Workload, shape: ModelShape, index: int | None = None) -> int:
    """Values per token decoder layer ``index``'s adapters keep for the backward: each lora_A's output (r, kept by
    lora_B), or each OFT layer's rotated input (in_features, kept by the frozen weight's matmul)."""
    if w.finetuning_type == "oft":
        return sum(adapted_widths(shape, w.lora_targets, index).values())
    return lora_module_count(w, shape, index) * w.lora_rank


def lora_module_count(w: Workload, shape: ModelShape | None = None, index: int | None = None) -> int:
    """Adapted linear layers in decoder layer ``index`` of ``shape`` (LLaMA's seven names without a shape)."""
    if not w.is_lora:
        return 0
    modules = lora_target_modules(w.lora_targets, shape)
    if shape is None:
        return len(modules)
    present = shape.layer_linear_shapes(index)
    return sum(1 for m in modules if m in present)
