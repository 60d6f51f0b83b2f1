"""DeepSpeed ZeRO's memory per device, as the paper models it plus the buffers DeepSpeed adds (symbols and
formulas: README.md here), and the settings read from its JSON."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardtune.estimate.activations import activation_bytes
from shardtune.estimate.adapter_shape import freeze_trainable_params, lora_small_params
from shardtune.estimate.grpo import rollout_bytes
from shardtune.estimate.parts import (
    FP32,
    CheckpointFn,
    CheckpointShare,
    Components,
    Context,
    Setup,
    StateFn,
    full_load_setup,
    reference_share,
    sharded_load_setup,
    with_reference_setup,
)
from shardtune.estimate.shape import ModelShape
from shardtune.estimate.workload import adapter_params, weight_bytes

# DeepSpeed's defaults (and the shipped presets) for the sizes that bound its buffers, in elements.
DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_SUB_GROUP = 1_000_000_000
DEFAULT_PERSISTENCE_THRESHOLD = 100_000


@dataclass(frozen=True)
class ZeroSettings:
    """What decides DeepSpeed's memory, read from its JSON (a preset or the user's file)."""

    stage: int
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET
    live_parameters: int = DEFAULT_LIVE_PARAMETERS
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD  # smaller parameters stay whole on every rank

def zero_settings(raw: dict, hidden_size: int) -> ZeroSettings:
    """Stage, offload and buffer sizes; "auto" sizes resolve as shardtune resolves them (deepspeed_config's
    auto_zero_sizes; hidden_size squared for the keys it has no rule for)."""
    from shardtune.engines.deepspeed_config import (
        auto_zero_sizes,
        offloads_optimizer,
        offloads_params,
        zero_section,
        zero_stage,
    )

    zero = zero_section(raw)

    def size(key: str, default: int) -> int:
        value = zero.get(key, default)
        if value == "auto":
            return auto_zero_sizes(hidden_size).get(key, hidden_size**2)
        return int(float(value))

    # Parameters are released after use only when not reused within max_reuse_distance, and at most
    # max_live_parameters stay gathered: the smaller of the two bounds the gathered working set.
    live = min(size("stage3_max_live_parameters", DEFAULT_LIVE_PARAMETERS),
               size("stage3_max_reuse_distance", DEFAULT_LIVE_PARAMETERS))
    return ZeroSettings(stage=max(zero_stage(raw), 0), offload_optimizer=offloads_optimizer(raw),
                        offload_params=offloads_params(raw), reduce_bucket_size=size("reduce_bucket_size",
                                                                                     DEFAULT_REDUCE_BUCKET),
                        live_parameters=live,
                        persistence_threshold=size("stage3_param_persistence_threshold",
                                                   DEFAULT_PERSISTENCE_THRESHOLD))

def preset_zero_settings(preset: str, hidden_size: int) -> ZeroSettings:
    """Settings of a shipped DeepSpeed preset (z1, z2, z2_offload, z3, z3_offload)."""
    from shardtune.engines.deepspeed_config import load_deepspeed_setting

    return zero_settings(load_deepspeed_setting(preset)[0], hidden_size)

def zero_divisors(stage: int, ranks: int) -> tuple[int, int, int]:
    """How many ranks share (parameters, gradients, optimizer states) at a ZeRO stage: the paper's
    P_os (stage 1), P_os+g (stage 2) and P_os+g+p (stage 3)."""
    return (ranks if stage >= 3 else 1, ranks if stage >= 2 else 1, ranks if stage >= 1 else 1)

def zero_paper_model_states(params: float, ranks: int, stage: int, k: float = 12, param_bytes: float = 2,
                            grad_bytes: float = 2) -> float:
    """Model-state bytes per device as in the ZeRO paper (Rajbhandari et al., 2020, figure 1): fp16 parameters
    and gradients (2 + 2 bytes) and K bytes of optimizer state per parameter (12 for mixed-precision Adam:
    fp32 master, momentum, variance), each divided by the ranks that share it at this stage."""
    p, g, o = zero_divisors(stage, ranks)
    return param_bytes * params / p + grad_bytes * params / g + k * params / o

def zero_states(c: Context, z: ZeroSettings) -> tuple[Components, float, Setup]:
    """DeepSpeed ZeRO as the paper models it (parameters and gradients in the module dtype b, K = 4 + optimizer
    state bytes for the fp32 master partition and states), plus what DeepSpeed adds as buffers: the gradient
    staging bucket and, at stage 3, the gathered parameters. DeepSpeed keeps the separate fp32 master partition
    even in fp32 training."""
    w, t, n, b = c.workload, c.trainable, c.ranks, c.ds_bytes
    p_div, g_div, o_div = zero_divisors(z.stage, n)
    weights = zero_weight_bytes(c, z)
    k = FP32 + w.optimizer_state_bytes
    activations = activation_bytes(c.shape, w, b)
    params, gathered = weights, 0.0
    if z.stage == 3:
        params = 0.0 if z.offload_params else weights / p_div
        gathered = weights * zero3_gathered_params(c, z) / c.params
    reference = reference_share(c, params)
    adapters = zero3_adapter_bytes(c, z)
    device = Components(
        parameters=params + adapters.kept + adapters.persisted,
        gradients=0.0 if z.offload_optimizer else b * t / g_div,
        optimizer_states=0.0 if z.offload_optimizer else k * t / o_div,
        buffers=gathered + staging_bucket_bytes(z, b, t, activations, c.hardware.on_gpu),
        activations=activations,
        reference=reference,
        rollout=rollout_bytes(c.shape, w, b),
    )
    offloaded = 0.0
    if z.offload_optimizer:
        offloaded += (FP32 + k) * t / n + b * t / n  # fp32 gradient partition, master + states, pinned copy
    if z.offload_params:
        offloaded += weights / n + reference_share(c, weights / n)
    # Below ZeRO-3 the replica is read whole into fp32 host memory first, as the policy is.
    host = reference_share(c, weight_bytes(c.shape, w, FP32)) if z.stage < 3 else 0.0
    return device, offloaded, with_reference_setup(zero_setup(c, z, weights), reference, host)

def zero3_gathered_params(c: Context, z: ZeroSettings) -> int:
    """Parameters ZeRO-3 holds gathered (whole) on each rank at the busiest point of a step, the largest of:

    * the bound: stage3_max_live_parameters (or max_reuse_distance, the smaller), up to the whole model;
    * one module's own parameters, which DeepSpeed gathers together whatever the bound says: the largest Linear
      layer or the embedding; an MoE block marked a leaf module with all its experts (moe_leaf_params);
    * with gradient checkpointing, one decoder layer's frozen parameters (recompute_held_params).
    """
    shape = c.shape
    largest_module = max([shape.embedding_params, shape.head_params,
                          *(shape.linear_params(name, i) for i in range(shape.num_layers)
                            for name in shape.layer_linear_shapes(i))])
    return max(min(c.params, z.live_parameters), largest_module, moe_leaf_params(shape),
               recompute_held_params(c))


def recompute_held_params(c: Context) -> int:
    """Frozen parameters of one decoder layer, which ZeRO-3 keeps gathered while the backward recomputes that
    layer and runs through it: DeepSpeed (0.19, partitioned_param_coordinator: ds_recompute_parameters) hands
    every frozen parameter a checkpoint's recompute gathers to the module whose backward is running and releases
    them only when that backward ends, so an adapter or freeze run holds a whole layer's base weights however
    small stage3_max_live_parameters is. Trainable parameters are released by their own backward hooks.
    Measured on the 206M-parameter LoRA run (docs/estimate.md, "Measured: ZeRO-3 LoRA"): 11.34M parameters
    gathered at once in each layer's backward with max_live_parameters 1e6, where the forward keeps one module's.
    """
    w, shape = c.workload, c.shape
    if not w.gradient_checkpointing or w.finetuning_type == "full":
        return 0
    # Freeze tuning of the last layers: the backward stops below them and holds their frozen modules only. Of
    # the first layers: it runs through the frozen last ones, held whole.
    trains_first_layers = w.freeze_trainable_layers < 0 and -w.freeze_trainable_layers < shape.num_layers
    if w.finetuning_type == "freeze" and not trains_first_layers:
        return max(0, shape.layer_params - freeze_trainable_params(shape, 1, w.freeze_trainable_modules))
    return shape.layer_params


def zero_weight_bytes(c: Context, z: ZeroSettings) -> float:
    """The weights as DeepSpeed holds them, in the module dtype b; but at ZeRO-3 an adapter's weights stay fp32:
    peft adds them after deepspeed.zero.Init has cast the model, and deepspeed.initialize partitions them as they
    are (measured on the 206M-parameter bf16 LoRA run: the adapters' partitions and whole copies are fp32)."""
    weights = weight_bytes(c.shape, c.workload, c.ds_bytes)
    if z.stage == 3 and c.workload.is_adapter:
        weights += (FP32 - c.ds_bytes) * adapter_params(c.shape, c.workload)
    return weights


@dataclass(frozen=True)
class AdapterBytes:
    """What a ZeRO-3 adapter run holds on each rank beyond the partitioned share of its weights (bytes)."""

    kept: float = 0.0  # for the whole run
    setup_only: float = 0.0  # until deepspeed.initialize partitions the adapters
    persisted: float = 0.0  # from the first step on


def zero3_adapter_bytes(c: Context, z: ZeroSettings) -> AdapterBytes:
    """A LoRA/OFT run under ZeRO-3 (measured: 206M-parameter LoRA on 2 CPU ranks, docs/estimate.md):

    * the sharded load (engines/sharded_loading.py, ``ShardedLoad.initial_values``) clones every new adapter
      weight, in fp32 as peft creates them, and the engine keeps that load for the whole run: 4·T on every rank;
    * before deepspeed.initialize partitions them, the adapters themselves are whole fp32 tensors on every rank:
      4·T more during set-up;
    * DeepSpeed keeps parameters below stage3_param_persistence_threshold elements whole on every rank, beside
      their 1/N partition: LoRA's A (r x in) and B (out x r) matrices at usual ranks, in fp32 (zero_weight_bytes). They
      are released like the others while the first step records its trace, and kept once it is complete.
    Not with offloaded parameters (the shard is in host memory, counted there).
    """
    w = c.workload
    if z.stage != 3 or not w.is_adapter or z.offload_params:
        return AdapterBytes()
    small = lora_small_params(c.shape, w.lora_rank, w.lora_targets, z.persistence_threshold) if w.is_lora else 0
    return AdapterBytes(kept=FP32 * c.trainable, setup_only=FP32 * c.trainable, persisted=FP32 * small)


def moe_leaf_params(shape: ModelShape) -> int:
    """Parameters of the largest sparse MoE block (every expert, the router, the shared experts): shardtune marks
    it a ZeRO-3 leaf module so that ranks routing to different experts gather the same parameters, and a leaf is
    gathered whole whatever stage3_max_live_parameters says. 0 for a dense model."""
    if shape.moe is None or shape.moe_layers == 0:
        return 0
    index = next(i for i in range(shape.num_layers) if shape.is_moe_layer(i))
    shared = sum(shape.linear_params(name, index) for name in shape.layer_linear_shapes(index)
                 if name not in shape.attention_linear_shapes())
    return shape.layer_expert_params(index) + shared

def staging_bucket_bytes(z: ZeroSettings, b: int, trainable: int, activations: float, on_gpu: bool) -> float:
    """Gradient memory of ZeRO's reduction beyond the gradient partition.

    Each backward copies gradients into a bucket (contiguous_gradients, torch.empty(reduce_bucket_size) every
    micro-step) and, when it reduces the bucket at the end of the backward, flattens them into one more tensor
    of the filled size. On a GPU the caching allocator reserves the whole bucket up front. In CPU memory only
    written pages are resident, and both buffers fill while the backward frees the activations, so they add
    only what exceeds the activations.
    """
    filled = b * min(z.reduce_bucket_size, trainable)
    if on_gpu:
        return b * z.reduce_bucket_size + max(0.0, filled - activations)
    return max(0.0, 2 * filled - activations)

def zero_setup(c: Context, z: ZeroSettings, weights: float) -> Setup:
    """ZeRO-1/2 load like DDP; deepspeed.initialize casts and moves the whole module, copies it into one flat
    buffer, then creates the fp32 master partition and the optimizer states by stepping once on zero gradients.
    The module and the flat buffer coexist only where there is room: DeepSpeed flattens on the GPU when it has
    the memory free, else through host memory; on CPU ranks the host is the device.

    ZeRO-3 builds the model inside deepspeed.zero.Init (a sharded load); creating the optimizer then fills a
    zeroed fp32 gradient buffer as large as the trainable parameters (up to sub_group_size) next to the
    partition, on the device unless the optimizer is offloaded."""
    if z.stage < 3:
        master_and_states = 0.0 if z.offload_optimizer else \
            (FP32 + c.workload.optimizer_state_bytes) * c.trainable / c.ranks
        flattening = weights if c.hardware.on_gpu else 2 * weights
        return full_load_setup(c, max(flattening, weights + master_and_states))
    load = sharded_load_setup(c, weights / c.ranks, c.ds_bytes, z.offload_params)
    if z.offload_optimizer:
        return load
    partition = 0.0 if z.offload_params else weights / c.ranks
    adapters = zero3_adapter_bytes(c, z)
    device = max(load.device, partition + FP32 * min(c.trainable, DEFAULT_SUB_GROUP))
    return replace(load, device=device + adapters.kept + adapters.setup_only)

def zero_preset_states(preset: str) -> StateFn:
    """The state function of an option that runs a DeepSpeed preset."""
    return lambda c: zero_states(c, preset_zero_settings(preset, c.shape.hidden_size))

def zero_checkpoint(c: Context, stage: int) -> CheckpointShare:
    """What DeepSpeed's ``save_checkpoint`` writes per rank (engines/deepspeed.py, save_state): each rank its partition
    of the fp32 master weights and optimizer states (K·T/N; at stage 0 rank 0 all of them); below ZeRO-3 the first
    rank also the module's weights in their dtype (b·P, only the trained ones for adapters: the frozen base is left
    out), while at ZeRO-3 each rank's module file holds only empty partitions."""
    w, t = c.workload, c.trainable
    optimizer = (FP32 + w.optimizer_state_bytes) * t
    if stage >= 3:
        return CheckpointShare.even(optimizer / c.ranks)
    module = c.ds_bytes * t if w.is_adapter else weight_bytes(c.shape, w, c.ds_bytes)
    if stage == 0:
        return CheckpointShare(module + optimizer, 0.0)
    return CheckpointShare(module + optimizer / c.ranks, optimizer / c.ranks)

def zero_preset_checkpoint(preset: str) -> CheckpointFn:
    """The checkpoint function of an option that runs a DeepSpeed preset."""
    return lambda c: zero_checkpoint(c, preset_zero_settings(preset, c.shape.hidden_size).stage)
