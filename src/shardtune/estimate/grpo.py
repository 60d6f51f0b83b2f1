"""Stage grpo's rollout phase in the estimate, and the generator process of rollout_backend vllm_protocol_cpu.

A grpo step first generates every group of its window (train/grpo_step.py: ``engine.generate`` under no_grad, one
group of num_generations rows at a time, train/rollout.py), then trains on them one group at a time. The phases do
not overlap: a group's cache is freed when its generate returns, before any training forward, so a device holds the
larger of the rollout and the activations on top of the model states (``Components.rollout``). The training phase
is the ordinary activation model on num_generations rows of seq_len tokens, with grpo's logits
(activations.grpo_logits_bytes). With num_iterations > 1, beta > 0 or the sampler correction, no_grad forwards of
the same rows run between the phases: the training forward's logits without its saved activations, not counted.

vllm_protocol_cpu moves generation into a process of its own on rank 0's node (train/protocol_generator.py): the
ranks then hold no rollout, and that process holds its weights and its rollouts in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardtune.estimate.activations import layer_activation_bytes
from shardtune.estimate.parts import CPU_RUNTIME_BYTES
from shardtune.estimate.shape import ModelShape
from shardtune.estimate.workload import Workload

FP32 = 4
# One decoding step's vocabulary-wide tensors (transformers' _sample): the model's last-position logits, their fp32
# copy, the processed scores and the sampling probabilities, each n x vocab (top-p's sort adds a few more).
STEP_LOGITS_COPIES = 4
# The generator process keeps every step's logits to return the sampler's log-probabilities (output_logits=True,
# n x vocab fp32 per step), and sampled_completions stacks them, divides them by the temperature and takes their
# log-softmax: the tuple and two [n, max_completion_length, vocab] fp32 tensors alive at once. Measured on the CPU
# (tiny LLaMA, 16-32 rows of 220-400 tokens, resident memory with large blocks mmap'd): cache + these within 3%.
SAMPLED_LOGITS_COPIES = 3


def kv_cache_bytes(shape: ModelShape, rows: int, tokens: int, cache_bytes: int) -> int:
    """The key/value cache of ``rows`` sequences of ``tokens``: per token and layer K and V (kv heads x head dim
    each); latent attention caches its compressed kv and its rope key instead (transformers' DeepSeek-V3 does); a
    sliding layer keeps its window only. transformers' cache takes K's dtype, and K after the rotary embedding has
    the residual stream's (``cache_bytes``): fp32 under the torch engines' autocast (not bf16), bf16/fp16 where
    DeepSpeed casts the module."""
    per_token = shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim if shape.mla else 2 * shape.kv_width
    windowed = min(tokens, shape.sliding_window or tokens)
    layer_tokens = (shape.num_layers - shape.sliding_layers) * tokens + shape.sliding_layers * windowed
    return rows * layer_tokens * per_token * cache_bytes


def cache_growth_bytes(shape: ModelShape, rows: int, tokens: int, cache_bytes: int) -> int:
    """The cache grows by concatenation (transformers' DynamicLayer: torch.cat of the old tensor and the new token),
    so each step holds one layer's K (or V, or latent) twice for a moment: the largest such tensor once more."""
    width = max(shape.mla.kv_lora_rank, shape.mla.qk_rope_head_dim) if shape.mla else shape.kv_width
    return rows * tokens * width * cache_bytes


def prompt_tokens(w: Workload) -> int:
    """The longest prompt: data/rl_prompts.py refuses one longer than cutoff_len - max_completion_length."""
    return max(w.seq_len - w.completion_tokens, 1)


def prefill_bytes(shape: ModelShape, w: Workload, stream_bytes: int) -> int:
    """A generation's first forward: the prompts' cache and one layer's tensors on the n x prompt tokens, with the
    residual stream in and out. Under no_grad a layer frees its tensors as the next one runs; what it would keep for
    a backward (layer_activation_bytes, the largest layer) bounds them. The prompts are whole rows without padding
    (train/rollout.py), so attention is causal without a mask; only the last position's logits are made."""
    prompt = prompt_tokens(w)
    unpadded = replace(w, dense_mask=False)
    layer = max(layer_activation_bytes(shape, unpadded, stream_bytes, prompt, i) for i in range(shape.num_layers))
    stream = 2 * shape.hidden_size * stream_bytes
    return kv_cache_bytes(shape, w.micro_batch, prompt, stream_bytes) + w.micro_batch * prompt * (layer + stream)


def decoding_bytes(shape: ModelShape, w: Workload, stream_bytes: int, logits_copies: int) -> int:
    """The end of a generation: the cache of every row at full length (seq_len: prompt + max_completion_length), as
    it grows (``cache_growth_bytes``), and the vocabulary-wide tensors: ``logits_copies`` x n x vocab fp32 per step
    (one step's), or per completion token when every step's logits are kept."""
    rows, tokens = w.micro_batch, w.seq_len
    cache = kv_cache_bytes(shape, rows, tokens, stream_bytes) + cache_growth_bytes(shape, rows, tokens, stream_bytes)
    return cache + logits_copies * rows * shape.output_rows * FP32


def rollout_bytes(shape: ModelShape, w: Workload, stream_bytes: int) -> int:
    """The rollout phase on a rank's device (0 outside grpo and under an external generator): the larger of one
    group's prefill and its last decoding step. The transformers back-end keeps no logits beyond a step's
    (train/rollout.py: the policy is its own sampler)."""
    if not w.is_grpo or w.external_generator:
        return 0
    return max(prefill_bytes(shape, w, stream_bytes), decoding_bytes(shape, w, stream_bytes, STEP_LOGITS_COPIES))


@dataclass(frozen=True)
class GeneratorHost:
    """Host memory of the vllm_protocol_cpu generator process (bytes): the whole model in the run's dtype (a LoRA
    run's generator holds the plain model: the sync sends merged weights), its rollouts (no autocast: the cache in
    that dtype too, and every step's logits kept for the sampler's log-probabilities) and an interpreter of its
    own."""

    weights: float
    rollouts: float
    runtime: float = CPU_RUNTIME_BYTES

    @property
    def total(self) -> float:
        return self.weights + self.rollouts + self.runtime


def generator_host(shape: ModelShape, w: Workload) -> GeneratorHost | None:
    """The generator process of rollout_backend vllm_protocol_cpu (None without one). The weight sync's bucket in
    flight (at most 256 MiB, train/weight_sync.py) is not counted."""
    if not (w.is_grpo and w.external_generator):
        return None
    b = w.compute_bytes
    sampled = decoding_bytes(shape, w, b, SAMPLED_LOGITS_COPIES * w.completion_tokens)
    return GeneratorHost(weights=shape.total_params * b, rollouts=max(prefill_bytes(shape, w, b), sampled))
