"""Per-device memory of every engine option, modelled on how shardtune runs each engine.

Torch engines (DDP, FSDP) keep fp32 weights and autocast to bf16/fp16; DeepSpeed casts the module to
bf16/fp16 and keeps an fp32 master partition. Symbols: P total parameters, T trainable parameters, N ranks
sharing the states (world size, or the ranks of one node for HYBRID_SHARD). Formulas: README.md here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from shardtune.estimate.activations import activation_bytes, autocast_weight_copy_bytes
from shardtune.estimate.hardware import GiB, Hardware
from shardtune.estimate.shape import ModelShape
from shardtune.estimate.workload import Workload, trainable_params, weight_bytes

FP32 = 4
# CUDA context, cuBLAS and NCCL workspaces: outside torch.cuda.max_memory_allocated, but on the device.
GPU_RUNTIME_BYTES = 1 * GiB
# The caching allocator's fragmentation, as a fraction of everything else on the device.
ALLOCATOR_RESERVE = 0.05
# Resident memory of one rank's interpreter with torch, transformers, datasets and DeepSpeed imported.
CPU_RUNTIME_BYTES = 1 * GiB
# DeepSpeed's defaults (and the shipped presets) for the sizes that bound its buffers, in elements.
DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_SUB_GROUP = 1_000_000_000


@dataclass(frozen=True)
class Components:
    """Bytes per device (or per rank in CPU memory) by what holds them."""

    parameters: float = 0.0  # this rank's share of the weights, as the engine keeps them between steps
    gradients: float = 0.0  # this rank's share of the gradients
    optimizer_states: float = 0.0  # this rank's share of the optimizer states (and DeepSpeed's fp32 master copy)
    buffers: float = 0.0  # transient copies: gathered weights, autocast casts, unreduced gradients, buckets
    activations: float = 0.0
    overhead: float = 0.0
    reference: float = 0.0  # a preference run's frozen reference model: this rank's share, as the policy's weights

    @property
    def total(self) -> float:
        return self.measurable + self.overhead

    @property
    def model_states(self) -> float:
        """Parameters + gradients + optimizer states: what ZeRO and FSDP divide among the ranks."""
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def measurable(self) -> float:
        """Every tensor of a step: model states, reference, buffers and activations (no runtime or allocator
        overhead)."""
        return self.model_states + self.reference + self.buffers + self.activations

    def to_dict(self) -> dict[str, int]:
        data = {f.name: int(round(getattr(self, f.name))) for f in fields(self)}
        data["total"] = int(round(self.total))
        return data


@dataclass(frozen=True)
class Setup:
    """Memory while the model is loaded and the engine sets up, before the first step (bytes)."""

    device: float  # on each rank's device
    host_per_rank: float = 0.0  # host memory each rank fills itself (its own full copy, or its offloaded shard)
    host_per_node: float = 0.0  # host memory held once per node: the checkpoint's copy in the page cache
    # Each rank maps the whole checkpoint file while it loads (from_pretrained), so its resident memory counts the
    # page-cache copy too; a sharded load opens the file for one tensor at a time and does not.
    rank_maps_checkpoint: bool = False

    @property
    def host_peak_per_rank(self) -> float:
        """A rank's resident memory while loading, where the device is the host (CPU runs)."""
        mapped = self.host_per_node if self.rank_maps_checkpoint else 0.0
        return max(self.device, self.host_per_rank + mapped)


@dataclass(frozen=True)
class Option:
    """One way to run the job, with its memory on each device and in each node's CPU memory."""

    name: str
    engine_values: dict[str, str]
    speed_rank: int  # lower is faster: less sharding, less offload
    device: Components
    cpu_per_rank: float  # host bytes per rank while training: the offloaded states (runtime not included)
    setup: Setup
    available: bool = True
    note: str = ""
    fits: bool = False
    cpu_per_node: float = 0.0  # the larger of set-up and training, plus every rank's runtime
    setup_cpu_per_node: float = 0.0  # while loading, without the runtime
    device_peak: float = 0.0

    @property
    def setup_device(self) -> float:
        return self.setup.device


StateFn = Callable[["Context"], tuple[Components, float, Setup]]


@dataclass(frozen=True)
class ZeroSettings:
    """What decides DeepSpeed's memory, read from its JSON (a preset or the user's file)."""

    stage: int
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET
    live_parameters: int = DEFAULT_LIVE_PARAMETERS


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
                        live_parameters=live)


def preset_zero_settings(preset: str, hidden_size: int) -> ZeroSettings:
    """Settings of a shipped DeepSpeed preset (z1, z2, z2_offload, z3, z3_offload)."""
    from shardtune.engines.deepspeed_config import load_deepspeed_setting

    return zero_settings(load_deepspeed_setting(preset)[0], hidden_size)


@dataclass(frozen=True)
class Context:
    """Everything an option's memory function reads."""

    shape: ModelShape
    workload: Workload
    hardware: Hardware

    @property
    def params(self) -> int:
        return self.shape.total_params

    @property
    def trainable(self) -> int:
        return trainable_params(self.shape, self.workload)

    @property
    def ranks(self) -> int:
        return self.hardware.world_size

    @property
    def ds_bytes(self) -> int:
        """DeepSpeed's module dtype: bf16/fp16 under mixed precision, else fp32."""
        return self.workload.compute_bytes


def reference_share(c: Context, held: float) -> float:
    """A live dpo/kto reference of a full/freeze run is the engine's frozen copy of the weights, placed as the
    policy's weights are (``Engine.load_frozen``): ``held``, the policy's weight bytes on this rank (a replica, or
    the shard; 0 where they are offloaded), once more. LoRA (adapters off), ORPO/SimPO and precomputed
    log-probabilities hold none; a LoRA run's ``ref_model`` is the policy's weights without its adapters (and
    unquantized: ``ref_model_quantization_bit`` is not modelled)."""
    if not c.workload.reference_copy:
        return 0.0
    frozen = replace(c.workload, finetuning_type="full", quantization_bit=None)
    return held * weight_bytes(c.shape, frozen, FP32) / weight_bytes(c.shape, c.workload, FP32)


def with_reference_setup(setup: Setup, reference: float, host: float) -> Setup:
    """The frozen reference is loaded beside the policy before training: ``reference`` more on the device and
    ``host`` more in the rank's host memory (a whole replica read into it)."""
    return replace(setup, device=setup.device + reference, host_per_rank=setup.host_per_rank + host)


# --- loading: how the weights reach each rank ---

def full_load_setup(c: Context, device_bytes: float) -> Setup:
    """DDP and ZeRO-1/2: every rank maps the whole checkpoint and reads it into fp32 weights on its host, then
    moves them (DeepSpeed: casts and moves them) to its device, where the engine builds its buffers."""
    return Setup(device=device_bytes, host_per_rank=weight_bytes(c.shape, c.workload, FP32),
                 host_per_node=c.shape.checkpoint_copy_bytes, rank_maps_checkpoint=True)


def sharded_load_setup(c: Context, shard: float, module_bytes: int, offload: bool) -> Setup:
    """FSDP and ZeRO-3: the model is created empty (meta device, deepspeed.zero.Init) and filled one tensor at
    a time from one checkpoint copy per node, so a rank holds its shard plus the piece being gathered (one
    layer or the embedding). With offload the shard lives in host memory and only the piece on the device."""
    piece = module_bytes * c.shape.largest_load_unit
    source = c.shape.checkpoint_copy_bytes
    if offload:
        return Setup(device=piece, host_per_rank=shard, host_per_node=source)
    return Setup(device=shard + piece, host_per_node=source)


# --- torch engines: DDP and FSDP ---

def ddp_states(c: Context) -> tuple[Components, float, Setup]:
    """Full fp32 weights, gradients and Adam states; the gradients are views into DDP's all-reduce buckets
    (``gradient_as_bucket_view``, engines/ddp.py), which exist from the wrap on."""
    w, t = c.workload, c.trainable
    weights = weight_bytes(c.shape, w, FP32)
    buckets = FP32 * t if c.ranks > 1 else 0  # allocated when DDP wraps the model; the gradients live in them
    reference = reference_share(c, weights)
    device = Components(
        parameters=weights,
        gradients=FP32 * t,
        optimizer_states=w.optimizer_state_bytes * t,
        buffers=autocast_weight_copy_bytes(c.shape, w),
        activations=activation_bytes(c.shape, w, FP32),
        reference=reference,
    )
    # The reducer allocates its buckets when DDP wraps the model (on the CPU they stay unwritten until a backward).
    return device, 0.0, with_reference_setup(full_load_setup(c, weights + buckets), reference, reference)


def fsdp_units(c: Context) -> tuple[float, float]:
    """fp32 bytes of the root unit (embeddings, final norm, lm_head; a vision tower's patch embedding and mergers:
    its blocks are units of their own) and of one decoder-layer unit."""
    s = c.shape
    root_params = s.embedding_params + s.head_params + s.hidden_size + (s.vision.unwrapped_params if s.vision else 0)
    root = FP32 * root_params
    decoder = s.total_params - root_params
    # The largest unit (an MoE layer with every expert, where layers differ): its share of the decoder's bytes.
    layer = (weight_bytes(s, c.workload, FP32) - root) * s.layer_params / decoder
    return root, layer


def fsdp_trainable_units(c: Context) -> tuple[float, float]:
    """fp32 gradient bytes of the root unit and of one layer unit before they are reduce-scattered."""
    s, w = c.shape, c.workload
    if w.finetuning_type != "full":
        return 0.0, FP32 * c.trainable / max(1, s.num_layers)
    root = FP32 * (s.embedding_params + s.head_params + s.hidden_size)
    return root, FP32 * s.layer_params


def fsdp_states(c: Context, group: int, reshard: bool, offload: bool) -> tuple[Components, float, Setup]:
    """FSDP2 over ``group`` ranks. The root unit stays gathered from forward to the end of backward; two layer
    units are gathered at a time (current + prefetched), or all of them after forward without resharding.

    Gradients: each unit's unsharded gradients live until its reduce-scatter (the root's until the end of the
    backward). With gradient accumulation the resharding strategies (FULL_SHARD, HYBRID_SHARD) reduce-scatter every
    micro-batch and accumulate the shard; the others (SHARD_GRAD_OP) turn gradient sync off for all but the last
    micro-batch, and FSDP then keeps the accumulated gradients unsharded: the whole fp32 gradient on every device
    (engines/fsdp.py, accumulation_context).
    """
    w, t = c.workload, c.trainable
    weights = weight_bytes(c.shape, w, FP32)
    root, layer = fsdp_units(c)
    gathered = root + (2 * layer if reshard else weights - root)
    kept = 0.0 if offload else 1.0  # offload keeps the shards in host memory
    grads: float
    if w.gradient_accumulation_steps > 1 and not reshard:
        grads, unreduced = FP32 * t, 0.0
    else:
        grads, unreduced = kept * FP32 * t / group, sum(fsdp_trainable_units(c))
    reference = reference_share(c, kept * weights / group)
    device = Components(
        parameters=kept * weights / group,
        gradients=grads,
        optimizer_states=kept * w.optimizer_state_bytes * t / group,
        buffers=gathered + unreduced + autocast_weight_copy_bytes(c.shape, w),
        activations=activation_bytes(c.shape, w, FP32),
        reference=reference,
    )
    offloaded = (weights + (FP32 + w.optimizer_state_bytes) * t) / group if offload else 0.0
    offloaded_reference = reference_share(c, weights / group) if offload else 0.0
    setup = sharded_load_setup(c, weights / group, FP32, offload)
    return device, offloaded + offloaded_reference, with_reference_setup(setup, reference, offloaded_reference)


# --- DeepSpeed ZeRO ---

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
    weights = weight_bytes(c.shape, w, b)
    k = FP32 + w.optimizer_state_bytes
    activations = activation_bytes(c.shape, w, b)
    params, gathered = weights, 0.0
    if z.stage == 3:
        params = 0.0 if z.offload_params else weights / p_div
        gathered = weights * max(min(c.params, z.live_parameters), moe_leaf_params(c.shape)) / c.params
    reference = reference_share(c, params)
    device = Components(
        parameters=params,
        gradients=0.0 if z.offload_optimizer else b * t / g_div,
        optimizer_states=0.0 if z.offload_optimizer else k * t / o_div,
        buffers=gathered + staging_bucket_bytes(z, b, t, activations, c.hardware.on_gpu),
        activations=activations,
        reference=reference,
    )
    offloaded = 0.0
    if z.offload_optimizer:
        offloaded += (FP32 + k) * t / n + b * t / n  # fp32 gradient partition, master + states, pinned copy
    if z.offload_params:
        offloaded += weights / n + reference_share(c, weights / n)
    # Below ZeRO-3 the replica is read whole into fp32 host memory first, as the policy is.
    host = reference_share(c, weight_bytes(c.shape, w, FP32)) if z.stage < 3 else 0.0
    return device, offloaded, with_reference_setup(zero_setup(c, z, weights), reference, host)


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
    return replace(load, device=max(load.device, partition + FP32 * min(c.trainable, DEFAULT_SUB_GROUP)))


def zero_preset_states(preset: str) -> StateFn:
    """The state function of an option that runs a DeepSpeed preset."""
    return lambda c: zero_states(c, preset_zero_settings(preset, c.shape.hidden_size))


# --- the options, fastest first ---


@dataclass(frozen=True)
class OptionSpec:
    """An engine option before it is evaluated: its name, config values, speed rank and memory function."""

    name: str
    engine_values: dict[str, str]
    speed_rank: int
    states: StateFn
    family: str  # "torch", "fsdp" or "deepspeed": availability rules differ
    offload: bool = False


OPTION_SPECS: tuple[OptionSpec, ...] = (
    OptionSpec("DDP", {}, 0, ddp_states, "torch"),
    OptionSpec("ZeRO-1", {"deepspeed": "z1"}, 1, zero_preset_states("z1"), "deepspeed"),
    OptionSpec("ZeRO-2", {"deepspeed": "z2"}, 2, zero_preset_states("z2"), "deepspeed"),
    OptionSpec("FSDP SHARD_GRAD_OP", {"fsdp": "shard_grad_op auto_wrap"}, 3,
               lambda c: fsdp_states(c, c.ranks, reshard=False, offload=False), "fsdp"),
    OptionSpec("FSDP HYBRID_SHARD", {"fsdp": "hybrid_shard auto_wrap"}, 4,
               lambda c: fsdp_states(c, c.hardware.gpus_per_node, reshard=True, offload=False), "fsdp"),
    OptionSpec("ZeRO-3", {"deepspeed": "z3"}, 5, zero_preset_states("z3"), "deepspeed"),
    OptionSpec("FSDP FULL_SHARD", {"fsdp": "full_shard auto_wrap"}, 5,
               lambda c: fsdp_states(c, c.ranks, reshard=True, offload=False), "fsdp"),
    OptionSpec("ZeRO-2+offload", {"deepspeed": "z2_offload"}, 6,
               zero_preset_states("z2_offload"), "deepspeed", offload=True),
    OptionSpec("ZeRO-3+offload", {"deepspeed": "z3_offload"}, 7,
               zero_preset_states("z3_offload"), "deepspeed", offload=True),
    OptionSpec("FSDP offload", {"fsdp": "full_shard auto_wrap offload"}, 7,
               lambda c: fsdp_states(c, c.ranks, reshard=True, offload=True), "fsdp", offload=True),
)


def unavailable_reason(spec: OptionSpec, c: Context) -> str:
    """Why shardtune would refuse this option for this job ('' when it would run)."""
    w, hw = c.workload, c.hardware
    if spec.offload and not hw.on_gpu:
        return "the ranks already run on the CPU"
    refusal = engine_refusal(spec, c)
    if refusal:
        return refusal
    if spec.family == "deepspeed" and spec.offload and w.optim not in ("adamw_torch", "adamw_torch_fused"):
        return f"optimizer offload runs DeepSpeedCPUAdam, not {w.optim}"
    if spec.name == "FSDP HYBRID_SHARD" and (hw.nodes < 2 or hw.gpus_per_node < 2):
        return "needs 2+ nodes with 2+ ranks each (on one node it is FULL_SHARD)"
    return ""


def engine_refusal(spec: OptionSpec, c: Context) -> str:
    """The engine's own first refusal of this workload, from its record (engines/spec.py), as `train` says it."""
    from shardtune.config.load import build_config
    from shardtune.engines.plan import plan_engine, spec_for

    w = c.workload
    values: dict[str, Any] = {"bf16": w.precision == "bf16", "fp16": w.precision == "fp16", "optim": w.optim,
                              "finetuning_type": "lora" if w.finetuning_type == "qlora" else w.finetuning_type,
                              **({"quantization_bit": w.quantization_bit} if w.quantization_bit else {}),
                              **spec.engine_values}
    config = build_config(values, source="estimate")
    plan, _ = plan_engine(config, c.ranks, has_cuda=c.hardware.on_gpu)
    problems = spec_for(plan.kind).refusals(config, plan, c.hardware.on_gpu)
    return problems[0] if problems else ""


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
    """Evaluate one option and decide whether it fits the hardware."""
    device, cpu_rank, setup = spec.states(c)
    hw = c.hardware
    device = with_overhead(device, hw.on_gpu)
    peak = max(device.total, setup.device)
    loading, training = node_cpu_bytes(device, cpu_rank, setup, hw)
    per_node = max(loading, training) + hw.gpus_per_node * CPU_RUNTIME_BYTES
    reason = unavailable_reason(spec, c)
    fits_device = not hw.on_gpu or peak <= (hw.gpu_memory or 0)
    fits = not reason and fits_device and per_node <= hw.cpu_memory
    return Option(spec.name, dict(spec.engine_values), spec.speed_rank, device, cpu_rank, setup,
                  available=not reason, note=reason, fits=fits, cpu_per_node=per_node, setup_cpu_per_node=loading,
                  device_peak=peak)


def build_options(shape: ModelShape, workload: Workload, hardware: Hardware) -> list[Option]:
    """Every engine option, fastest first."""
    c = Context(shape, workload, hardware)
    return [build_option(spec, c) for spec in OPTION_SPECS]
