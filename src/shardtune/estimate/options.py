"""Per-device memory of every engine option, modelled on how shardtune runs each engine (the torch engines here,
DeepSpeed ZeRO in estimate/zero.py, the shared pieces in estimate/parts.py).

Torch engines (DDP, FSDP) keep fp32 weights and autocast to bf16/fp16; DeepSpeed casts the module to
bf16/fp16 and keeps an fp32 master partition. Symbols: P total parameters, T trainable parameters, N ranks
sharing the states (world size, or the ranks of one node for HYBRID_SHARD). Formulas: README.md here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardtune.estimate.activations import activation_bytes, autocast_weight_copy_bytes
from shardtune.estimate.adapter_shape import lora_base_params
from shardtune.estimate.expert_parallel import (
    dispatch_bytes,
    gathered_layer_params,
    held_share,
    held_trainable,
    splits_experts,
)
from shardtune.estimate.grpo import generator_host, rollout_bytes
from shardtune.estimate.hardware import Hardware
from shardtune.estimate.parts import (
    ALLOCATOR_RESERVE,
    CPU_RUNTIME_BYTES,
    FP32,
    GPU_RUNTIME_BYTES,
    CheckpointFn,
    CheckpointShare,
    Components,
    Context,
    Option,
    Setup,
    StateFn,
    full_load_setup,
    reference_share,
    sharded_load_setup,
    with_reference_setup,
)
from shardtune.estimate.shape import ModelShape
from shardtune.estimate.workload import Workload, language_trained, weight_bytes
from shardtune.estimate.zero import zero_preset_checkpoint, zero_preset_states

# --- torch engines: DDP and FSDP ---

def ddp_states(c: Context) -> tuple[Components, float, Setup]:
    """Full fp32 weights, gradients and Adam states; the gradients are views into DDP's all-reduce buckets
    (``gradient_as_bucket_view``, engines/ddp.py), which exist from the wrap on."""
    w, t = c.workload, c.trainable
    weights = weight_bytes(c.shape, w, FP32)
    buckets = FP32 * t if c.ranks > 1 else 0  # allocated when DDP wraps the model; the gradients live in them
    reference = reference_share(c, weights)
    bases = lora_bases_in_compute_dtype(c)
    # A base stored in bf16 is the tensor the backward keeps: no autocast copy of it (checkpointing keeps none).
    uncopied = 0 if w.gradient_checkpointing else w.compute_bytes * bases
    device = Components(
        parameters=weights - (FP32 - w.compute_bytes) * bases,
        gradients=FP32 * t,
        optimizer_states=w.optimizer_state_bytes * t,
        buffers=autocast_weight_copy_bytes(c.shape, w) - uncopied,
        activations=activation_bytes(c.shape, w, FP32),
        reference=reference,
        rollout=rollout_bytes(c.shape, w, FP32),
    )
    # The reducer allocates its buckets when DDP wraps the model (on the CPU they stay unwritten until a backward).
    return device, 0.0, with_reference_setup(full_load_setup(c, weights + buckets), reference, reference)

def ddp_checkpoint(c: Context) -> CheckpointShare:
    """The main rank writes every trained weight (fp32, as DDP and one process keep them) and the optimizer states;
    the others only their RNG state (engines/torch_native.py, save_state)."""
    return CheckpointShare(first_rank=(FP32 + c.workload.optimizer_state_bytes) * c.trainable)

def lora_bases_in_compute_dtype(c: Context) -> int:
    """Parameters one process and DDP keep in the autocast dtype: the frozen bases of plain LoRA layers
    (model/finetuning/lora.py, store_frozen_bases_in); DoRA and quantized bases keep theirs."""
    w = c.workload
    if w.finetuning_type != "lora" or not w.mixed_precision or w.use_dora or w.quantization_bit is not None:
        return 0
    return lora_base_params(c.shape, w.lora_targets) if language_trained(c.shape, w) else 0

def fsdp_units(c: Context) -> tuple[float, float]:
    """fp32 bytes of the root unit (embeddings, final norm, lm_head; a vision tower's patch embedding and mergers:
    its blocks are units of their own) and of one decoder-layer unit."""
    s = c.shape
    root_params = s.embedding_params + s.head_params + s.hidden_size + (s.vision.unwrapped_params if s.vision else 0)
    root = FP32 * root_params
    decoder = s.total_params - root_params
    # The largest unit (an MoE layer with every expert, or this rank's experts under expert parallelism, where
    # layers differ): its share of the decoder's bytes.
    layer = (weight_bytes(s, c.workload, FP32) - root) * gathered_layer_params(s, c.workload) / decoder
    return root, layer

def fsdp_trainable_units(c: Context) -> tuple[float, float]:
    """fp32 gradient bytes of the root unit and of one layer unit before they are reduce-scattered."""
    s, w = c.shape, c.workload
    if w.finetuning_type != "full":
        return 0.0, FP32 * c.trainable / max(1, s.num_layers)
    root = FP32 * (s.embedding_params + s.head_params + s.hidden_size)
    return root, FP32 * gathered_layer_params(s, w)

def fsdp_stored_weight_bytes(c: Context) -> float:
    """All weights as FSDP2 stores them: fp32, except that under mixed precision an adapter run's frozen weights are
    stored in the compute dtype, in which FSDP gathers them anyway (engines/fsdp.py, store_frozen_in_gather_dtype)."""
    w = c.workload
    weights = weight_bytes(c.shape, w, FP32)
    if not (w.is_adapter and w.mixed_precision and w.quantization_bit is None):
        return weights
    frozen = weights - FP32 * c.trainable
    return weights - frozen * (1 - w.compute_bytes / FP32)

def fsdp_reference_share(c: Context, kept: float, group: int) -> float:
    """A full run's frozen reference: its shard of every weight, in the compute dtype under mixed precision (all its
    weights are frozen, and stored as FSDP gathers them)."""
    return reference_share(c, kept * weight_bytes(c.shape, c.workload, c.workload.compute_bytes) / group)

def fsdp_states(c: Context, group: int, reshard: bool, offload: bool) -> tuple[Components, float, Setup]:
    """FSDP2 over ``group`` ranks. The root unit stays gathered from forward to the end of backward; two layer
    units are gathered at a time (current + prefetched), or all of them after forward without resharding.

    Gradients: each unit's unsharded gradients live until its reduce-scatter (the root's until the end of the
    backward). With gradient accumulation the resharding strategies (FULL_SHARD, HYBRID_SHARD) reduce-scatter every
    micro-batch and accumulate the shard; the others (SHARD_GRAD_OP) turn gradient sync off for all but the last
    micro-batch, and FSDP then keeps the accumulated gradients unsharded: the whole fp32 gradient on every device
    (engines/fsdp.py, accumulation_context). Under expert parallelism "whole" is this rank's experts and the rest.
    """
    w, t = c.workload, c.trainable
    weights = weight_bytes(c.shape, w, FP32)
    stored = fsdp_stored_weight_bytes(c)
    root, layer = fsdp_units(c)
    gathered = root + (2 * layer if reshard else (weights - root) * held_share(c.shape, w))
    kept = 0.0 if offload else 1.0  # offload keeps the shards in host memory
    grads: float
    if w.gradient_accumulation_steps > 1 and not reshard:
        grads, unreduced = FP32 * held_trainable(c.shape, w, t), 0.0
    else:
        grads, unreduced = kept * FP32 * t / group, sum(fsdp_trainable_units(c))
    reference = fsdp_reference_share(c, kept, group)
    device = Components(
        parameters=kept * stored / group,
        gradients=grads,
        optimizer_states=kept * w.optimizer_state_bytes * t / group,
        buffers=gathered + unreduced + autocast_weight_copy_bytes(c.shape, w) + dispatch_bytes(c.shape, w, FP32),
        activations=activation_bytes(c.shape, w, FP32),
        reference=reference,
        rollout=rollout_bytes(c.shape, w, FP32),
    )
    offloaded = (stored + (FP32 + w.optimizer_state_bytes) * t) / group if offload else 0.0
    offloaded_reference = fsdp_reference_share(c, 1.0, group) if offload else 0.0
    setup = sharded_load_setup(c, stored / group, FP32, offload)
    return device, offloaded + offloaded_reference, with_reference_setup(setup, reference, offloaded_reference)

def fsdp_checkpoint(c: Context, group: int) -> CheckpointShare:
    """Each rank writes its shard of the model's state dict (every weight as FSDP stores it; QLoRA leaves the frozen
    4-bit base out) and of the optimizer states, through torch's distributed checkpoint (engines/fsdp.py)."""
    w = c.workload
    weights = FP32 * c.trainable if w.quantization_bit is not None else fsdp_stored_weight_bytes(c)
    return CheckpointShare.even((weights + w.optimizer_state_bytes * c.trainable) / group)

# --- the options, fastest first ---


@dataclass(frozen=True)
class OptionSpec:
    """An engine option before it is evaluated: its name, config values, speed rank and memory function."""

    name: str
    engine_values: dict[str, str]
    speed_rank: int
    states: StateFn
    family: str  # "torch", "fsdp" or "deepspeed": availability rules differ
    checkpoint: CheckpointFn
    offload: bool = False


def _zero(preset: str) -> tuple[StateFn, str, CheckpointFn]:
    return zero_preset_states(preset), "deepspeed", zero_preset_checkpoint(preset)

def _fsdp_sharded_by_world(c: Context) -> CheckpointShare:
    return fsdp_checkpoint(c, c.ranks)

def _fsdp_sharded_by_node(c: Context) -> CheckpointShare:
    return fsdp_checkpoint(c, c.hardware.gpus_per_node)

OPTION_SPECS: tuple[OptionSpec, ...] = (
    OptionSpec("DDP", {}, 0, ddp_states, "torch", ddp_checkpoint),
    OptionSpec("ZeRO-1", {"deepspeed": "z1"}, 1, *_zero("z1")),
    OptionSpec("ZeRO-2", {"deepspeed": "z2"}, 2, *_zero("z2")),
    OptionSpec("FSDP SHARD_GRAD_OP", {"fsdp": "shard_grad_op auto_wrap"}, 3,
               lambda c: fsdp_states(c, c.ranks, reshard=False, offload=False), "fsdp", _fsdp_sharded_by_world),
    OptionSpec("FSDP HYBRID_SHARD", {"fsdp": "hybrid_shard auto_wrap"}, 4,
               lambda c: fsdp_states(c, c.hardware.gpus_per_node, reshard=True, offload=False), "fsdp",
               _fsdp_sharded_by_node),
    OptionSpec("ZeRO-3", {"deepspeed": "z3"}, 5, *_zero("z3")),
    OptionSpec("FSDP FULL_SHARD", {"fsdp": "full_shard auto_wrap"}, 5,
               lambda c: fsdp_states(c, c.ranks, reshard=True, offload=False), "fsdp", _fsdp_sharded_by_world),
    OptionSpec("ZeRO-2+offload", {"deepspeed": "z2_offload"}, 6, *_zero("z2_offload"), offload=True),
    OptionSpec("ZeRO-3+offload", {"deepspeed": "z3_offload"}, 7, *_zero("z3_offload"), offload=True),
    OptionSpec("FSDP offload", {"fsdp": "full_shard auto_wrap offload"}, 7,
               lambda c: fsdp_states(c, c.ranks, reshard=True, offload=True), "fsdp", _fsdp_sharded_by_world,
               offload=True),
)

def unavailable_reason(spec: OptionSpec, c: Context) -> str:
    """Why shardtune would refuse this option for this job ('' when it would run)."""
    w, hw = c.workload, c.hardware
    if spec.offload and not hw.on_gpu:
        return "the ranks already run on the CPU"
    refusal = engine_refusal(spec, c)
    if refusal:
        return refusal
    if splits_experts(c.shape, w):
        refusal = expert_parallel_refusal(spec, c)
        if refusal:
            return refusal
    if spec.family == "deepspeed" and spec.offload and w.optim not in ("adamw_torch", "adamw_torch_fused"):
        return f"optimizer offload runs DeepSpeedCPUAdam, not {w.optim}"
    if spec.name == "FSDP HYBRID_SHARD" and (hw.nodes < 2 or hw.gpus_per_node < 2):
        return "needs 2+ nodes with 2+ ranks each (on one node it is FULL_SHARD)"
    return ""

def engine_refusal(spec: OptionSpec, c: Context) -> str:
    """The engine's own first refusal of this workload, from its record (engines/spec.py), as `train` says it."""
    from shardtune.engines.plan import plan_engine, spec_for

    config = _estimate_config(spec, c)
    plan, _ = plan_engine(config, c.ranks, has_cuda=c.hardware.on_gpu)
    problems = spec_for(plan.kind).refusals(config, plan, c.hardware.on_gpu)
    return problems[0] if problems else ""

def expert_parallel_refusal(spec: OptionSpec, c: Context) -> str:
    """The expert-parallel plan's refusal of this option's engine (only FSDP2 FULL_SHARD and SHARD_GRAD_OP split
    experts: engines/expert_parallel_plan.py), as `train` says it."""
    from shardtune.engines.expert_parallel_plan import engine_problems
    from shardtune.engines.plan import plan_engine

    config = _estimate_config(spec, c)
    plan, _ = plan_engine(config, c.ranks, has_cuda=c.hardware.on_gpu)
    problems = engine_problems(plan, f"expert_parallel_size ({c.workload.expert_parallel})")
    return problems[0] if problems else ""

def _estimate_config(spec: OptionSpec, c: Context) -> Any:
    """A config with the workload's keys and this option's engine values, for the engines' own rules."""
    from shardtune.config.load import build_config

    w = c.workload
    values: dict[str, Any] = {"bf16": w.precision == "bf16", "fp16": w.precision == "fp16", "optim": w.optim,
                              "finetuning_type": "lora" if w.finetuning_type == "qlora" else w.finetuning_type,
                              **({"quantization_bit": w.quantization_bit} if w.quantization_bit else {}),
                              **spec.engine_values}
    return build_config(values, source="estimate")

def with_overhead(device: Components, on_gpu: bool) -> Components:
    """Add the GPU runtime and the allocator reserve (nothing on CPU ranks: their runtime is in CPU memory)."""
    if not on_gpu:
        return device
    return replace(device, overhead=GPU_RUNTIME_BYTES + ALLOCATOR_RESERVE * device.measurable)

def node_cpu_bytes(device: Components, cpu_per_rank: float, setup: Setup, hw: Hardware) -> tuple[float, float]:
    """CPU memory of one node without the runtime: (while loading, while training).

    On CPU ranks the device memory is this node's RAM, so a rank's device bytes count there too.
    """
    ranks = hw.gpus_per_node
    if hw.on_gpu:
        return ranks * setup.host_per_rank + setup.host_per_node, ranks * cpu_per_rank
    loading = ranks * max(setup.device, setup.host_per_rank) + setup.host_per_node
    return loading, ranks * max(device.total, cpu_per_rank)

def build_option(spec: OptionSpec, c: Context) -> Option:
    """Evaluate one option and decide whether it fits the hardware.

    Under async_save each rank keeps one staged copy of what it writes in a checkpoint in host memory while training
    goes on (engines/checkpoint_writer.py: a save waits for the previous one, so never two): the node's training
    memory holds its ranks' checkpoint once more. grpo's vllm_protocol_cpu generator, started after the model is
    loaded, adds its process to the training memory of rank 0's node."""
    device, cpu_rank, setup = spec.states(c)
    hw = c.hardware
    device = with_overhead(device, hw.on_gpu)
    peak = max(device.total, setup.device)
    checkpoint = spec.checkpoint(c)
    checkpoint_per_node = checkpoint.per_node(hw.gpus_per_node)
    staging = checkpoint_per_node if c.workload.async_save else 0.0
    generator = generator_host(c.shape, c.workload)
    generator_bytes = generator.total if generator else 0.0
    loading, training = node_cpu_bytes(device, cpu_rank, setup, hw)
    per_node = max(loading, training + staging + generator_bytes) + hw.gpus_per_node * CPU_RUNTIME_BYTES
    reason = unavailable_reason(spec, c)
    fits_device = not hw.on_gpu or peak <= (hw.gpu_memory or 0)
    fits = not reason and fits_device and per_node <= hw.cpu_memory
    return Option(spec.name, dict(spec.engine_values), spec.speed_rank, device, cpu_rank, setup,
                  available=not reason, note=reason, fits=fits, cpu_per_node=per_node, setup_cpu_per_node=loading,
                  device_peak=peak, checkpoint=checkpoint, checkpoint_per_node=checkpoint_per_node,
                  staging_per_node=staging, generator_per_node=generator_bytes)

def build_options(shape: ModelShape, workload: Workload, hardware: Hardware) -> list[Option]:
    """Every engine option, fastest first."""
    c = Context(shape, workload, hardware)
    return [build_option(spec, c) for spec in OPTION_SPECS]
