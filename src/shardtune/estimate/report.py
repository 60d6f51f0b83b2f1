"""The estimate as a table for people and as JSON for scripts (same content)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from shardtune.estimate.activations import sequence_mode
from shardtune.estimate.expert_parallel import describe_expert_parallel, expert_parallel_dict
from shardtune.estimate.grpo import generator_host, kv_cache_bytes, prompt_tokens
from shardtune.estimate.hardware import GiB, Hardware, format_size
from shardtune.estimate.parts import Option
from shardtune.estimate.recommend import Recommendation
from shardtune.estimate.shape import ModelShape
from shardtune.estimate.workload import Workload, trainable_params
from shardtune.world import WorldLayout


@dataclass(frozen=True)
class Estimate:
    """Everything the report shows."""

    shape: ModelShape
    workload: Workload
    hardware: Hardware
    options: list[Option]
    recommendation: Recommendation


def option_dict(o: Option) -> dict[str, Any]:
    """One option for JSON: bytes per component on a device, its peak, set-up and CPU memory."""
    return {
        "name": o.name,
        "engine_values": o.engine_values,
        "available": o.available,
        "fits": o.fits,
        "note": o.note,
        "device_bytes": o.device.to_dict(),
        "model_states_bytes": int(round(o.device.model_states)),
        "device_peak_bytes": int(round(o.device_peak)),
        "setup_device_bytes": int(round(o.setup_device)),
        "setup_cpu_bytes_per_node": int(round(o.setup_cpu_per_node)),
        "cpu_bytes_per_rank": int(round(o.cpu_per_rank)),
        "cpu_bytes_per_node": int(round(o.cpu_per_node)),
        "checkpoint_bytes_first_rank": int(round(o.checkpoint.first_rank)),
        "checkpoint_bytes_other_rank": int(round(o.checkpoint.other_rank)),
        "checkpoint_bytes_per_node": int(round(o.checkpoint_per_node)),
        "async_save_staging_bytes_per_node": int(round(o.staging_per_node)),
        "generator_bytes_per_node": int(round(o.generator_per_node)),
    }


def estimate_dict(e: Estimate) -> dict[str, Any]:
    """JSON-ready: one object per option with its bytes per component."""
    best = e.recommendation.option
    return {
        "model": {**asdict(e.shape), "total_params": e.shape.total_params, "active_params": e.shape.active_params,
                  "trainable_params": trainable_params(e.shape, e.workload)},
        "workload": asdict(e.workload),
        "hardware": {**asdict(e.hardware), "world_size": e.hardware.world_size},
        "expert_parallel": expert_parallel_dict(e.shape, e.workload, e.hardware.nodes, e.hardware.gpus_per_node),
        "options": [option_dict(o) for o in e.options],
        "recommendation": {"name": best.name if best else None,
                           "engine_values": best.engine_values if best else None,
                           "reason": e.recommendation.reason},
    }


COLUMNS = ("option", "params", "grads", "optim", "buffers", "activ", "overhead", "per GPU", "setup", "CPU/node",
           "fits")


def render_table(e: Estimate) -> str:
    """Header lines, one row per option (GiB), and the recommendation with its reason; a 'ref' column after
    'optim' when a preference run holds a frozen reference model, a 'rollout' column after 'activ' for stage grpo,
    and a 'staging' column before 'CPU/node' (with its line below the table) under async_save."""
    with_ref, staged, grpo = e.workload.reference_copy, e.workload.async_save, e.workload.is_grpo
    columns = COLUMNS[:4] + (("ref",) if with_ref else ()) + COLUMNS[4:6] + (("rollout",) if grpo else ()) \
        + COLUMNS[6:9] + (("staging",) if staged else ()) + COLUMNS[9:]
    rows = [columns] + [_row(o, e.hardware, with_ref, staged, grpo) for o in e.options]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = [_header(e), ""]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(widths[i + 1]) for i, c in enumerate(row[1:-1])] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    if staged:
        lines += ["", *staging_lines(e)]
    if e.hardware.on_gpu and any(_setup_dominates(o) for o in e.options):
        lines += ["", "* the peak comes while the model is loaded and the engine sets up (the 'setup' column)"]
    notes = [f"  {o.name}: {o.note}" for o in e.options if o.note]
    if notes:
        lines += ["", "not available:", *notes]
    best = e.recommendation.option
    lines += ["", f"recommended: {best.name} ({_values(best)})" if best else "recommended: none",
              f"why: {e.recommendation.reason}"]
    return "\n".join(lines)


def _header(e: Estimate) -> str:
    s, w = e.shape, e.workload
    trainable = trainable_params(s, w)
    method = w.finetuning_type + (f" r={w.lora_rank}" if w.is_lora else "")
    checkpointing = "on" if w.gradient_checkpointing else "off"
    batch = "one grpo group per forward:" if w.is_grpo else "micro batch"
    return "\n".join([
        f"model: {s.source or s.model_type} ({s.total_params / 1e9:.3g}B params; {method}, "
        f"{trainable / 1e9:.3g}B trainable)",
        *architecture_lines(s),
        f"run: {w.precision}, {batch} {w.micro_batch} x {w.seq_len} tokens, gradient checkpointing "
        f"{checkpointing}, {w.attn_implementation} attention, {w.optim}",
        *_preference_lines(w, e.shape),
        *grpo_lines(s, w),
        *image_text_lines(s, w),
        *_sequence_parallel_lines(e),
        *describe_expert_parallel(s, w, e.hardware.nodes, e.hardware.gpus_per_node),
        f"hardware: {e.hardware.describe()} (world size {e.hardware.world_size})",
        "memory per device in GiB; 'buffers' are transient copies (gathered weights, autocast casts, unreduced "
        "gradients, buckets); 'setup' is the peak while the model loads and the engine shards it; 'CPU/node' adds "
        "every rank of a node (the copies loaded, offloaded states, 1 GiB runtime each)",
    ])


def staging_lines(e: Estimate) -> list[str]:
    """What async_save holds in host memory: per option, what rank 0 and every other rank stage (GiB)."""
    shares = "; ".join(f"{o.name} {_rank_shares(o)}" for o in e.options)
    return ["async_save staging (host): each rank holds one copy of what it writes in a checkpoint (its shard of the "
            "weights and optimizer states) until it is written; 'staging' is the node with rank 0, included in "
            "CPU/node",
            f"  per rank in GiB: {shares}"]


def _rank_shares(o: Option) -> str:
    first, other = o.checkpoint.first_rank, o.checkpoint.other_rank
    return _gib(first) if first == other else f"{_gib(first)} on rank 0, {_gib(other)} on the others"


def _sequence_parallel_lines(e: Estimate) -> list[str]:
    w = e.workload
    if not w.splits_sequences:
        return []
    layout = WorldLayout(e.hardware.nodes, e.hardware.gpus_per_node, sequence_parallel=w.sequence_parallel)
    return [f"sequence parallel: {w.sequence_parallel} ranks per sequence (mode {sequence_mode(e.shape, w)}), "
            f"{w.local_seq_len} of {w.seq_len} tokens per rank; data parallel: {layout.data_parallel_size}"]


def image_text_lines(s: ModelShape, w: Workload) -> list[str]:
    """An image-text model's tower and projector (what trains), and what the estimate assumed of the images."""
    v = s.vision
    if v is None:
        return []
    frozen = w.frozen_parts
    states = {"vision tower": frozen.vision_tower, "projector": frozen.multi_modal_projector,
              "language model": frozen.language_model}
    held = ", ".join(f"{part} {'frozen' if off else 'trained'}" for part, off in states.items())
    lines = [f"image-text model: vision tower {v.tower_params / 1e6:.3g}M + projector {v.projector_params / 1e6:.3g}M "
             f"params ({v.model_type}, {v.depth} blocks of width {v.width}), held by every engine as the other "
             f"weights; {held}"]
    if not w.images_per_sample:
        return [*lines, "images: none in the data (no images column): the tower does not run"]
    tokens = v.tokens_per_image(w.image_max_pixels)
    return [*lines, f"images: assumed {w.images_per_sample} per sample at image_max_pixels ({w.image_max_pixels}): "
            f"{v.patches_per_image(w.image_max_pixels)} patches through the tower and {tokens} tokens each; image "
            f"tokens count toward cutoff_len ({w.seq_len}) as text tokens do"]


def _preference_lines(w: Workload, s: ModelShape) -> list[str]:
    if w.rows_per_sample == 1:
        return []
    if s.score_head:
        where = "none (a reward model is trained alone)"
    elif w.reference_copy:
        where = ("a frozen copy of the weights, held as the policy's (replica under DDP/ZeRO-1/2, sharded under "
                 "ZeRO-3/FSDP): the 'ref' column")
    else:
        where = "none in memory (LoRA: adapters off; ORPO/SimPO; or precomputed log-probabilities)"
    return [f"preference: {w.rows_per_sample} rows per sample in one forward (activations and logits for "
            f"{w.micro_batch * w.rows_per_sample} rows); reference model: {where}"]


def grpo_lines(s: ModelShape, w: Workload) -> list[str]:
    """Stage grpo's two phases, named as the table's columns: the rollouts ('rollout', or the generator process
    of vllm_protocol_cpu in host memory) and the training forwards ('activ'); a step holds the larger."""
    if not w.is_grpo:
        return []
    rows, tokens, vocab = w.micro_batch, w.seq_len, s.output_rows
    training = (f"grpo training phase ('activ'): one group's forward and backward at a time, {rows} rows x {tokens} "
                f"tokens (prompt up to {prompt_tokens(w)} + completion {w.completion_tokens}), full logits "
                f"({rows} x {tokens} x {vocab}; loss_chunk_size does not apply); the no_grad forwards of old and "
                "reference log-probabilities hold less")
    generator = generator_host(s, w)
    if generator is not None:
        return [f"grpo rollout phase: none on the ranks ('rollout' 0): rollout_backend vllm_protocol_cpu generates in "
                f"a process of its own on rank 0's node, {format_size(generator.total)} of host memory in CPU/node "
                f"(weights in {w.precision} {format_size(generator.weights)}, its rollouts "
                f"{format_size(generator.rollouts)}: KV cache and every step's fp32 logits, interpreter "
                f"{format_size(generator.runtime)})", training]
    caches = {format_size(kv_cache_bytes(s, rows, tokens, b)): name for b, name in
              ((w.compute_bytes, f"{w.precision} under DeepSpeed"), (4, "fp32 under DDP/FSDP's autocast"))}
    cache = ", ".join(f"{size} at {name}" for size, name in caches.items()) if len(caches) > 1 else next(iter(caches))
    rollout = (f"grpo rollout phase ('rollout'; no_grad, before the training forwards; a step holds the larger phase): "
               f"one group's generation, its KV cache of {rows} rows x {tokens} tokens ({cache}) and one step's "
               f"{rows} x {vocab} logits, or its prefill where larger")
    return [rollout, training]


def architecture_lines(s: ModelShape) -> list[str]:
    """What the estimate took from the architecture beyond a dense LLaMA: experts, latent attention, tied
    embeddings, sliding windows, attention sinks."""
    lines = []
    if not s.counts_checked:
        lines.append(f"model_type {s.model_type}: read as a LLaMA-style decoder; this family's layers are not checked "
                     "against transformers, so its counts are approximate")
    if s.moe:
        m = s.moe
        shared = f" + shared width {m.shared_intermediate}" if m.shared_intermediate else ""
        dense = f", {len(m.dense_layers)} dense layers" if m.dense_layers else ""
        lines.append(f"mixture of experts: {m.experts} experts, top-{m.top_k}{shared}{dense}; "
                     f"{s.total_params / 1e9:.3g}B total, {s.active_params / 1e9:.3g}B active per token "
                     f"(every expert is resident, and trains under full fine-tuning; activations follow the "
                     f"top-{m.top_k})")
    if s.mla:
        a = s.mla
        lines.append(f"latent attention: q_lora_rank {a.q_lora_rank}, kv_lora_rank {a.kv_lora_rank}, "
                     f"qk head {a.qk_nope_head_dim}+{a.qk_rope_head_dim} (nope+rope), v head {a.v_head_dim}")
    if s.score_head:
        lines.append("reward model (stage rm): a one-row score layer replaces the output head; the logits are one "
                     "score per token, not the vocabulary")
    elif s.tie_word_embeddings:
        lines.append("tied embeddings: the embedding and the output head are one matrix (counted once)")
    if s.sliding_window:
        lines.append(f"sliding window {s.sliding_window} on {s.sliding_layers} of {s.num_layers} layers: no memory "
                     "term shrinks (eager and sdpa mask the full scores; flash-attention stores nothing per S)")
    if s.attention_sinks:
        lines.append("attention sinks: one learned logit per head (GPT-OSS; eager attention)")
    return lines


def _row(o: Option, hw: Hardware, with_ref: bool = False, staged: bool = False, grpo: bool = False
         ) -> tuple[str, ...]:
    d = o.device
    fits = "yes" if o.fits else ("n/a" if not o.available else "no")
    peak = _gib(o.device_peak) + ("*" if _setup_dominates(o) else "") if hw.on_gpu else "-"
    ref = (_gib(d.reference),) if with_ref else ()
    rollout = (_gib(d.rollout),) if grpo else ()
    staging = (_gib(o.staging_per_node),) if staged else ()
    return (o.name, _gib(d.parameters), _gib(d.gradients), _gib(d.optimizer_states), *ref, _gib(d.buffers),
            _gib(d.activations), *rollout, _gib(d.overhead), peak, _gib(o.setup_device), *staging,
            _gib(o.cpu_per_node), fits)


def _setup_dominates(o: Option) -> bool:
    return o.setup_device > o.device.total


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.1f}" if num_bytes >= 0.05 * GiB or num_bytes == 0 else f"{num_bytes / GiB:.2f}"


def _values(option: Option) -> str:
    values = ", ".join(f"{k}: {v}" for k, v in option.engine_values.items())
    return values or "no deepspeed/fsdp key"

