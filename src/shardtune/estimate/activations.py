"""Activation memory of a decoder (LLaMA-style, MoE, latent attention): what autograd keeps for the backward.

Counted tensor by tensor from transformers' LlamaDecoderLayer as shardtune runs it (checked with
``torch.autograd.graph.saved_tensors_hooks``; see README.md in this folder). All sizes are per token;
multiply by micro batch x sequence length. ``stream_bytes`` is the dtype of the residual stream (the module's
weights: 4 when shardtune keeps fp32 weights and autocasts, 2 when DeepSpeed casts the module to bf16/fp16).
"""

from __future__ import annotations

from shardtune.data.settings import takes_offsets
from shardtune.engines.sequence_parallel_plan import resolved_mode
from shardtune.estimate.expert_parallel import combine_bytes_per_token
from shardtune.estimate.shape import ModelShape
from shardtune.estimate.vision_shape import VisionShape
from shardtune.estimate.workload import (
    Workload,
    adapted_vision_linears,
    adapter_activation_width,
    grad_path_indices,
    grad_path_layers,
    language_trained,
    projector_trains,
    tower_trains,
)

FP32 = 4
# Autocast casts the fp32 input of each of q/k/v/gate/up_proj to bf16 separately (it caches casts of weights
# only), and each linear keeps its own cast for the backward.
AUTOCAST_CAST_INPUTS = 5
# With loss_chunk_size 0 the loss is computed in fp32 on [micro_batch, seq, vocab] logits. Three such tensors
# are alive at the forward/backward boundary: the (fp32 copy of the) logits and the log-softmax at the end of
# the forward, then the saved log-softmax, its incoming gradient and its outgoing gradient during the first
# backward op. Chunked (shardtune.train.loss), one [chunk, vocab] fp32 tensor is alive at a time, plus, under
# mixed precision, the compute-dtype logits it is cast from (or, in the backward, cast to).
LOGITS_COPIES = 3
# grpo's loss (completion_logps, train/grpo_loss.py) takes the model's logits over every position (compute dtype),
# then fp32 copies of the completion positions only: in the forward the fp32 copy and the tempered one (two), in the
# backward of the log-sum-exp four (the saved input, two temporaries, the gradient). Measured with a dispatch-level
# tracker (torch 2.13, CPU): bf16 within 2%; fp32 up to 8% less (the CPU's log-sum-exp keeps no exp temporary).
GRPO_FORWARD_COMPLETION_COPIES = 2
GRPO_BACKWARD_COMPLETION_COPIES = 4


def norm_bytes(h: int, stream_bytes: int, trainable_weight: bool, output_kept: bool = True) -> int:
    """RMSNorm: its fp32 input (a copy when the stream is bf16), 1/rms, x/rms when the weight trains, and its
    output when a linear layer reads it (not for Gemma's and GLM-4's post-norms, which feed the residual add)."""
    normalized = h * stream_bytes if trainable_weight else 0
    return h * FP32 + FP32 + normalized + (h * stream_bytes if output_kept else 0)


def head_norm_bytes(width: int, heads: int, compute_bytes: int, trainable_weight: bool) -> int:
    """Per-head q or k RMSNorm (Qwen3, Gemma 3): the fp32 input, one 1/rms per head, the normalized values
    (compute dtype) when the weight trains; the output goes to the rotary embedding, which keeps nothing of it."""
    return width * FP32 + heads * FP32 + (width * compute_bytes if trainable_weight else 0)


def attention_bytes(shape: ModelShape, w: Workload, seq_len: int) -> int:
    """Saved by scaled-dot-product attention: q, k, v, output, log-sum-exp and the mask or the probabilities.

    With a dense mask (padding, packing) transformers cannot use SDPA's native GQA and repeats k and v to all
    heads; SDPA keeps a floating copy of the mask per layer. Eager attention keeps the softmax probabilities
    (fp32, plus their cast under mixed precision) instead; with attention sinks (GPT-OSS) over one more column.
    flash_attention_2 and varlen (torch's varlen flash kernel; on the CPU SDPA's causal kernel per sample) keep
    neither. A sliding window changes none of these: eager and SDPA compute and mask the
    full [S, S] scores (the window only shapes the mask), and flash-attention-2, which skips the blocks outside
    the window, stores nothing that grows with S anyway.
    """
    cb = w.compute_bytes
    kernel = attention_kernel(shape, w)
    flash = takes_offsets(kernel)
    mode = sequence_mode(shape, w)
    if shape.mla:
        size = cb * mla_projection_width(shape) + FP32 * shape.num_heads
    else:
        q = shape.q_width
        kv = 2 * (shape.kv_width if flash or shape.num_kv_heads == shape.num_heads else q)
        if mode == "allgather":  # SDPA keeps the gathered K and V: the whole row's, for each of this rank's tokens
            kv *= w.sequence_parallel
        size = cb * (q + kv + q) + FP32 * shape.num_heads
    if kernel == "eager":
        columns = seq_len + (1 if shape.attention_sinks else 0)
        softcap = cb if shape.attn_softcapping else 0  # tanh(scores / cap) is kept for its backward
        return size + shape.num_heads * columns * (FP32 + (cb if cb != FP32 else 0) + softcap)
    if flash or mode == "ulysses" or (mode is None and not w.dense_mask):
        return size  # ulysses attends each segment with sdpa's causal flag: no mask (engines/sequence_parallel.py)
    if mode == "allgather":
        # A segment begun on earlier slices gets stand-in queries for those tokens (the last rank's: the whole row
        # before its slice): their queries, outputs and log-sum-exp, (N - 1) per token of this rank's slice.
        return size + (w.sequence_parallel - 1) * (2 * cb * shape.q_width + FP32 * shape.num_heads)
    return size + seq_len * cb


def sequence_mode(shape: ModelShape, w: Workload) -> str | None:
    """How the ranks of a split row exchange attention inputs (None: rows are not split); ``auto`` is decided from
    the shape's heads as the ranks decide it."""
    if not w.splits_sequences:
        return None
    heads = {"num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads}
    return resolved_mode(w.sequence_parallel_mode, heads, w.sequence_parallel)


def exchange_bytes(shape: ModelShape, w: Workload) -> int:
    """The buffers one layer's attention exchange holds for a moment under sequence parallelism (one layer at a
    time): ulysses sends and receives q, k, v and the output (about 2 x those activations of the rank's tokens);
    allgather gathers K and V of the whole row ([batch, kv heads, cutoff_len, head dim] x 2)."""
    mode = sequence_mode(shape, w)
    if mode is None:
        return 0
    cb, q, k = w.compute_bytes, shape.q_width, shape.kv_width
    if mode == "ulysses":
        return 2 * w.tokens * cb * (q + 2 * k + q)
    return 2 * w.micro_batch * w.rows_per_sample * w.seq_len * k * cb


def attention_kernel(shape: ModelShape, w: Workload) -> str:
    """The kernel that runs: GPT-OSS's attention sinks have no SDPA path in transformers, so sdpa means eager.
    ``auto`` is estimated as what it picks without flash-attn (flash keeps less, so this is the safe side): sdpa,
    or eager for models with sinks or Gemma 2's soft-capping, which have no SDPA path (model/attention.py). A split
    row's attention always runs sdpa (engines/sequence_parallel.py)."""
    if w.splits_sequences:
        return "sdpa"
    if w.attn_implementation == "auto":
        return "eager" if shape.attention_sinks or shape.attn_softcapping else "sdpa"
    if shape.attention_sinks and w.attn_implementation == "sdpa":
        return "eager"
    return w.attn_implementation


def mla_projection_width(shape: ModelShape) -> int:
    """Elements per token latent attention keeps besides its latent norms: q and k after the rotary embedding
    (heads x qk_head_dim each), v and the output (heads x v_head_dim each), and the shared rope key (the kv latent
    norm reads a view of kv_a's output, so its input holds the rope part too). q_b's and kv_b's outputs are split
    and concatenated into q, k and v, and nothing keeps them. (torch's SDPA needs equal q/k and v head dims for
    its flash kernel: on the CPU MLA falls back to the math path, which keeps the probabilities like eager.)"""
    m, a = shape.mla, shape.num_heads
    assert m is not None
    return 2 * shape.q_width + 2 * a * m.v_head_dim + m.qk_rope_head_dim


def norms_bytes(shape: ModelShape, w: Workload, stream_bytes: int) -> int:
    """The layer's RMSNorms: two (or Gemma's and GLM-4's four) over h, the per-head q/k norms (Qwen3, Gemma 3),
    MLA's norms of the q and kv latents (which read a compute-dtype input)."""
    trainable = w.finetuning_type in ("full", "freeze")
    h = shape.hidden_size
    total = 2 * norm_bytes(h, stream_bytes, trainable)
    total += (shape.norms_per_layer - 2) * norm_bytes(h, stream_bytes, trainable, output_kept=False)
    if shape.qk_norm:
        cb = w.compute_bytes
        total += (head_norm_bytes(shape.q_width, shape.num_heads, cb, trainable)
                  + head_norm_bytes(shape.kv_width, shape.num_kv_heads, cb, trainable))
    if shape.mla:
        for width in (shape.mla.q_lora_rank, shape.mla.kv_lora_rank):
            total += norm_bytes(width, w.compute_bytes, trainable) if width else 0
    return total


def cast_width(shape: ModelShape, index: int) -> int:
    """Elements per token that autocast casts to bf16/fp16 for the layer's linear calls: every linear reading
    the fp32 stream or a norm's output (q/k/v, gate/up, fused projections, MLA's latents; not o_proj or down_proj,
    whose inputs are already compute-dtype) and an MoE router. Each call casts its own copy."""
    skip = {"o_proj", "down_proj", "shared_expert_gate"}
    width = sum(fan_in for name, (fan_in, _, _) in shape.layer_linear_shapes(index).items() if name not in skip)
    return width + (shape.hidden_size if shape.is_moe_layer(index) else 0)


def mlp_bytes(shape: ModelShape, w: Workload, index: int, stream_bytes: int | None = None) -> int:
    """A gated MLP keeps gate, up, act(gate) and act(gate)*up (4i). An MoE layer keeps that for each of the
    top-k experts a token goes to, plus the token's gathered input and the expert output it weights (2h each),
    the router's logits and fp32 probabilities (and the routing weights and indices), the shared experts as a
    plain MLP, and with the load-balancing loss (output_router_logits) one more fp32 softmax of the logits; under
    expert parallelism the combine's fp32 copy of every choice's returned row (estimate/expert_parallel.py).

    The fused experts run through transformers' grouped_mm, which autocast does not cover: it casts its input to
    the weights' dtype, so under DDP/FSDP (fp32 weights, autocast) the experts compute and keep fp32 tensors;
    under DeepSpeed (the module cast to bf16) bf16 ones. ``stream_bytes`` is that weight dtype."""
    cb = w.compute_bytes
    if not shape.is_moe_layer(index):
        return 4 * shape.intermediate_size * cb
    moe = shape.moe
    assert moe is not None
    eb = stream_bytes or cb
    kept_widths = 7 if moe.clamped_swiglu else 4  # gate_up (2i) + act and product, or GPT-OSS's five
    experts = moe.top_k * eb * (2 * shape.hidden_size + kept_widths * moe.expert_intermediate)
    router = moe.experts * (cb + FP32) + moe.top_k * (FP32 + 8) + (moe.experts * FP32 if moe.aux_loss else 0)
    shared = 4 * moe.shared_intermediate * cb + (2 * shape.hidden_size * cb if moe.shared_gate else 0)
    return experts + router + shared + combine_bytes_per_token(shape, w, index)


def layer_activation_bytes(shape: ModelShape, w: Workload, stream_bytes: int, seq_len: int,
                           index: int | None = None) -> int:
    """Bytes per token that decoder layer ``index`` (the last by default) keeps for its backward."""
    index = shape.num_layers - 1 if index is None else index
    cb = w.compute_bytes
    autocast = stream_bytes == FP32 and cb != FP32
    casts = cast_width(shape, index) * cb if autocast else 0
    adapters = adapter_activation_width(w, shape, index) * cb
    return (norms_bytes(shape, w, stream_bytes) + casts + attention_bytes(shape, w, seq_len)
            + mlp_bytes(shape, w, index, stream_bytes) + adapters)


def final_bytes(shape: ModelShape, w: Workload, stream_bytes: int) -> int:
    """Bytes per token outside the layers: the final norm and what the head keeps.

    The plain head keeps its input (the norm's output) and, under autocast, its cast. The chunked loss keeps
    instead a copy of the trainable positions' hidden states (counted for every token: an upper bound) and one
    fp32 log-sum-exp per position.
    """
    norm = norm_bytes(shape.hidden_size, stream_bytes, w.finetuning_type == "full")
    if w.is_loss_chunked:
        return norm + FP32
    autocast = stream_bytes == FP32 and w.compute_bytes != FP32
    return norm + (shape.hidden_size * w.compute_bytes if autocast else 0)


def decoder_activation_bytes(shape: ModelShape, w: Workload, stream_bytes: int) -> int:
    """All layers: full activations, or with gradient checkpointing each layer's input plus one recomputed layer."""
    path = grad_path_indices(shape, w)
    per_layer = [layer_activation_bytes(shape, w, stream_bytes, w.seq_len, i) for i in path]
    if w.gradient_checkpointing:  # each layer keeps its input; the largest layer is recomputed at some point
        per_token = len(path) * shape.hidden_size * stream_bytes + max(per_layer, default=0)
    else:
        per_token = sum(per_layer)
    return w.tokens * (per_token + final_bytes(shape, w, stream_bytes))


def logits_bytes(shape: ModelShape, w: Workload, weight_bytes: int = FP32) -> int:
    """The fp32 loss over the vocabulary: all tokens' logits, or one chunk's (see LOGITS_COPIES).

    The chunked loss sums the head's weight gradient chunk by chunk, so when the head trains that gradient
    (``weight_bytes`` per element, before the engine takes it) exists beside the chunk; the full-logits path
    creates it only after two of its three copies are freed. grpo takes its own path (``grpo_logits_bytes``).
    """
    if w.is_grpo:
        return grpo_logits_bytes(shape, w)
    if not w.is_loss_chunked:
        return LOGITS_COPIES * w.tokens * shape.output_rows * FP32
    cast = w.compute_bytes if w.mixed_precision else 0
    head_gradient = shape.output_rows * shape.hidden_size * weight_bytes if w.finetuning_type == "full" else 0
    return min(w.loss_chunk_size, w.tokens) * shape.output_rows * (FP32 + cast) + head_gradient


def grpo_logits_bytes(shape: ModelShape, w: Workload) -> int:
    """One grpo group's logits in its training forward and backward (loss_chunk_size does not apply): the larger of
    the forward's (every position's logits in the compute dtype and two fp32 copies of the completion positions) and
    the backward's (four fp32 copies of the completion positions); see GRPO_*_COMPLETION_COPIES."""
    completion = w.micro_batch * w.completion_tokens * shape.output_rows * FP32
    every_position = w.micro_batch * w.seq_len * shape.output_rows * w.compute_bytes
    return max(every_position + GRPO_FORWARD_COMPLETION_COPIES * completion,
               GRPO_BACKWARD_COMPLETION_COPIES * completion)


def input_bytes(w: Workload, shape: ModelShape | None = None) -> int:
    """The batch: input_ids, labels and position_ids (int64), and the dense [B, 1, S, S] boolean attention
    mask that packed rows carry (transformers builds the same from a padding mask). A model with both local and
    global layers (Gemma 2/3, GPT-OSS) gets two masks, a full one and a sliding one."""
    masks = 2 if shape is not None and 0 < shape.sliding_layers < shape.num_layers else 1
    if w.splits_sequences:  # whole rows of ids, labels, positions and segment ids; no mask (segment spans instead)
        return w.micro_batch * w.rows_per_sample * w.seq_len * 4 * 8
    mask = 0 if takes_offsets(w.attn_implementation) or not w.dense_mask else masks * w.seq_len
    return w.tokens * (3 * 8 + mask)


def activation_bytes(shape: ModelShape, w: Workload, stream_bytes: int) -> int:
    return (decoder_activation_bytes(shape, w, stream_bytes) + logits_bytes(shape, w, stream_bytes)
            + input_bytes(w, shape) + exchange_bytes(shape, w) + vision_activation_bytes(shape, w, stream_bytes))


def vision_activation_bytes(shape: ModelShape, w: Workload, stream_bytes: int) -> int:
    """The vision tower's share of a micro-batch with images: an upper bound, every image at image_max_pixels.

    The pixel inputs (fp32, one row of channels x frames x patch^2 per patch, for each micro-batch of the step) and
    the image features the projector hands to the language model; then per patch: a tower that trains keeps every
    block (with gradient checkpointing each block's input and one recomputed block), a frozen one keeps nothing and
    holds one block's tensors at a time; the projector's mergers keep their inputs when the tower or the projector
    trains. The image tokens are
    part of cutoff_len and counted with the language model's tokens.
    """
    v = shape.vision
    if v is None or not w.images_per_sample:
        return 0
    images = w.micro_batch * w.rows_per_sample * w.images_per_sample
    patches = images * v.patches_per_image(w.image_max_pixels)
    features = images * v.tokens_per_image(w.image_max_pixels) * v.text_hidden * w.compute_bytes
    trains = tower_trains(shape, w)
    block = tower_block_bytes(v, w, stream_bytes, shape)
    if not trains:
        kept = block
    elif w.gradient_checkpointing:
        kept = v.depth * v.width * stream_bytes + block
    else:
        kept = v.depth * block
    mergers = (1 + v.deepstack_run) * merger_bytes(v, w, stream_bytes) if trains or projector_trains(shape, w) else 0
    # The loop holds a step's micro-batches together (train/loop.py, accumulation_windows): their pixels too.
    pixels = w.gradient_accumulation_steps * v.patch_values * FP32
    return patches * (pixels + kept + mergers) + features


def tower_block_bytes(v: VisionShape, w: Workload, stream_bytes: int, shape: ModelShape) -> int:
    """Bytes per patch one tower block keeps for its backward, as a decoder layer does (activations of the same
    kinds): two norms, q/k/v and the output of attention with its log-sum-exp (eager attention: the probabilities
    over the image's patches), the MLP (gated: 4i, else 2i), autocast's casts of the linear inputs, the adapters'."""
    cb = w.compute_bytes
    autocast = stream_bytes == FP32 and cb != FP32
    mlp_inputs = 2 if v.is_gated else 1
    casts = (1 + mlp_inputs) * v.width * cb if autocast else 0
    attention = cb * 4 * v.width + FP32 * v.heads
    if w.attn_implementation == "eager":
        attention += v.heads * v.patches_per_image(w.image_max_pixels) * (FP32 + (cb if cb != FP32 else 0))
    mlp = (4 if v.is_gated else 2) * v.intermediate * cb
    full = w.finetuning_type == "full" and tower_trains(shape, w)
    per_block = [linear for linear in adapted_vision_linears(shape, w, "tower") if linear[4] >= v.depth]
    adapters = sum(a if w.finetuning_type == "oft" else w.lora_rank for _, a, _, _, _ in per_block) * cb
    return 2 * norm_bytes(v.width, stream_bytes, full) + casts + attention + mlp + adapters


def merger_bytes(v: VisionShape, w: Workload, stream_bytes: int) -> int:
    """Bytes per patch one merger keeps: its norm, and the inputs of its two linears and of the activation between
    them (merge^2 patches side by side make one row of merge^2 x width)."""
    return norm_bytes(v.width, stream_bytes, True) + 3 * v.width * w.compute_bytes


def autocast_weight_copy_bytes(shape: ModelShape, w: Workload) -> int:
    """bf16/fp16 copies of fp32 weights that autocast makes in the forward and the backward still needs.

    Autocast caches the cast of every trainable weight until the forward ends, and a linear layer on the
    backward path saves the cast of a frozen weight for the input gradient (not inside a checkpointed layer,
    which saves nothing). So at the end of the forward the copies are alive together with the activations.
    bitsandbytes weights are dequantized per call and keep no copy. Only torch engines autocast (DeepSpeed
    casts the module itself). lm_head is outside the checkpointed layers and always counts.
    """
    if not w.mixed_precision:
        return 0
    trainable_layers = 0
    if w.finetuning_type == "full" and language_trained(shape, w):
        trainable_layers = shape.num_layers
    elif w.finetuning_type == "freeze":
        trainable_layers = min(abs(w.freeze_trainable_layers), shape.num_layers)
    frozen_on_path = grad_path_layers(shape, w) - trainable_layers
    if w.gradient_checkpointing or w.quantization_bit:
        frozen_on_path = 0
    layers = range(shape.num_layers - trainable_layers - frozen_on_path, shape.num_layers)
    head = shape.output_rows * shape.hidden_size
    return w.compute_bytes * (sum(cast_weight_params(shape, i) for i in layers) + head
                              + trained_vision_linear_params(shape, w))


def trained_vision_linear_params(shape: ModelShape, w: Workload) -> int:
    """Linear weights of the tower and the projector that train in full (their autocast casts are cached); only when
    a micro-batch has images does the tower run."""
    v = shape.vision
    if v is None or not w.images_per_sample or w.finetuning_type != "full":
        return 0
    linears = (v.tower_linears() if tower_trains(shape, w) else []) + \
        (v.projector_linears() if projector_trains(shape, w) else [])
    return sum(count * a * b for _, a, b, _, count in linears)


def cast_weight_params(shape: ModelShape, index: int) -> int:
    """Weights of layer ``index`` that autocast copies: its nn.Linear weights. The fused experts are sliced per
    expert (``gate_up_proj[e]``, not a leaf), so autocast does not cache their casts: each is freed after use."""
    return shape.layer_linear_param_count(index)
