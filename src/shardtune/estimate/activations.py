"""Activation memory of a LLaMA-style decoder: what autograd keeps from the forward for the backward.

Counted tensor by tensor from transformers' LlamaDecoderLayer as shardtune runs it (checked with
``torch.autograd.graph.saved_tensors_hooks``; see README.md in this folder). All sizes are per token;
multiply by micro batch x sequence length. ``stream_bytes`` is the dtype of the residual stream (the module's
weights: 4 when shardtune keeps fp32 weights and autocasts, 2 when DeepSpeed casts the module to bf16/fp16).
"""

from __future__ import annotations

from shardtune.estimate.shape import ModelShape
from shardtune.estimate.workload import Workload, grad_path_layers, lora_module_count

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


def norm_bytes(h: int, stream_bytes: int, trainable_weight: bool) -> int:
    """RMSNorm: its fp32 input (a copy when the stream is bf16), 1/rms, x/rms when the weight trains, output."""
    normalized = h * stream_bytes if trainable_weight else 0
    return h * FP32 + FP32 + normalized + h * stream_bytes


def attention_bytes(shape: ModelShape, w: Workload, seq_len: int) -> int:
    """Saved by scaled-dot-product attention: q, k, v, output, log-sum-exp and the mask or the probabilities.

    With a dense mask (padding, packing) transformers cannot use SDPA's native GQA and repeats k and v to all
    heads; SDPA keeps a floating copy of the mask per layer. Eager attention keeps the softmax probabilities
    (fp32, plus their cast under mixed precision) instead. flash_attention_2 keeps neither.
    """
    cb = w.compute_bytes
    q = shape.q_width
    flash = w.attn_implementation.startswith("flash")
    kv = 2 * (shape.kv_width if flash or shape.num_kv_heads == shape.num_heads else q)
    size = cb * (q + kv + q) + FP32 * shape.num_heads
    if w.attn_implementation == "eager":
        return size + shape.num_heads * seq_len * (FP32 + (cb if cb != FP32 else 0))
    if flash:
        return size
    return size + seq_len * cb


def layer_activation_bytes(shape: ModelShape, w: Workload, stream_bytes: int, seq_len: int) -> int:
    """Bytes per token that one decoder layer keeps for its backward."""
    h, cb = shape.hidden_size, w.compute_bytes
    trainable_norms = w.finetuning_type in ("full", "freeze")
    autocast = stream_bytes == FP32 and cb != FP32
    casts = AUTOCAST_CAST_INPUTS * h * cb if autocast else 0
    mlp = 4 * shape.intermediate_size * cb  # gate, up, silu(gate), silu(gate) * up
    lora = lora_module_count(w) * w.lora_rank * cb  # the output of each lora_A, kept by lora_B
    return 2 * norm_bytes(h, stream_bytes, trainable_norms) + casts + attention_bytes(shape, w, seq_len) + mlp + lora


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
    layers = grad_path_layers(shape, w)
    per_layer = layer_activation_bytes(shape, w, stream_bytes, w.seq_len)
    if w.gradient_checkpointing:
        per_token = layers * shape.hidden_size * stream_bytes + per_layer
    else:
        per_token = layers * per_layer
    return w.tokens * (per_token + final_bytes(shape, w, stream_bytes))


def logits_bytes(shape: ModelShape, w: Workload, weight_bytes: int = FP32) -> int:
    """The fp32 loss over the vocabulary: all tokens' logits, or one chunk's (see LOGITS_COPIES).

    The chunked loss sums the head's weight gradient chunk by chunk, so when the head trains that gradient
    (``weight_bytes`` per element, before the engine takes it) exists beside the chunk; the full-logits path
    creates it only after two of its three copies are freed.
    """
    if not w.is_loss_chunked:
        return LOGITS_COPIES * w.tokens * shape.vocab_size * FP32
    cast = w.compute_bytes if w.mixed_precision else 0
    head_gradient = shape.vocab_size * shape.hidden_size * weight_bytes if w.finetuning_type == "full" else 0
    return min(w.loss_chunk_size, w.tokens) * shape.vocab_size * (FP32 + cast) + head_gradient


def input_bytes(w: Workload) -> int:
    """The batch: input_ids, labels and position_ids (int64), and the dense [B, 1, S, S] boolean attention
    mask that packed rows carry (transformers builds the same from a padding mask)."""
    mask = 0 if w.attn_implementation.startswith("flash") else w.seq_len
    return w.tokens * (3 * 8 + mask)


def activation_bytes(shape: ModelShape, w: Workload, stream_bytes: int) -> int:
    return decoder_activation_bytes(shape, w, stream_bytes) + logits_bytes(shape, w, stream_bytes) + input_bytes(w)


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
    if w.finetuning_type == "full":
        trainable_layers = shape.num_layers
    elif w.finetuning_type == "freeze":
        trainable_layers = min(abs(w.freeze_trainable_layers), shape.num_layers)
    frozen_on_path = grad_path_layers(shape, w) - trainable_layers
    if w.gradient_checkpointing or w.quantization_bit:
        frozen_on_path = 0
    layers = trainable_layers + frozen_on_path
    head = shape.vocab_size * shape.hidden_size
    return w.compute_bytes * (layers * shape.layer_linear_params + head)
