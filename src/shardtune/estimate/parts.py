"""The pieces every engine option's memory is built from: bytes by holder (``Components``), what loading adds
(``Setup``), an evaluated ``Option``, and the ``Context`` a memory function reads, with the loading paths and the
frozen reference that all engines share (estimate/options.py: the torch engines; estimate/zero.py: DeepSpeed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

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
    # grpo's rollout phase (estimate/grpo.py): a phase of its own before the training forwards, so a step holds the
    # larger of it and the activations
    rollout: float = 0.0

    @property
    def total(self) -> float:
        return self.measurable + self.overhead

    @property
    def model_states(self) -> float:
        """Parameters + gradients + optimizer states: what ZeRO and FSDP divide among the ranks."""
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def measurable(self) -> float:
        """Every tensor of a step: model states, reference, buffers and activations, or grpo's rollouts where they
        are larger (no runtime or allocator overhead)."""
        return self.model_states + self.reference + self.buffers + max(self.activations, self.rollout)

    def to_dict(self) -> dict[str, int]:
        """Bytes by holder and the total; 'rollout' only where a rank generates (grpo), so that the JSON of every
        other run keeps the keys scripts read."""
        data = {f.name: int(round(getattr(self, f.name))) for f in fields(self) if f.name != "rollout" or self.rollout}
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
class CheckpointShare:
    """Bytes one rank writes in a checkpoint: its weights in the dtype it stores them and its optimizer states (the
    scheduler and RNG states are a few KB). The first rank's and every other rank's: they differ where rank 0 writes
    what the others do not (DDP's whole state, the module file below ZeRO-3)."""

    first_rank: float = 0.0
    other_rank: float = 0.0

    @classmethod
    def even(cls, per_rank: float) -> CheckpointShare:
        """Every rank writes its own shard of the same size."""
        return cls(per_rank, per_rank)

    def per_node(self, ranks_per_node: int) -> float:
        """What the ranks of one node write in a checkpoint: of the node with rank 0, the largest (what a scheduler
        must wait for before it kills a node, and what async_save stages in its host memory)."""
        return self.first_rank + (ranks_per_node - 1) * self.other_rank


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
    checkpoint: CheckpointShare = CheckpointShare()  # what each rank writes in one checkpoint
    checkpoint_per_node: float = 0.0  # what the ranks of the first node write in one checkpoint (the largest node)
    # async_save: the staged copy of checkpoint_per_node in the first node's host memory (counted in cpu_per_node);
    # 0 without async_save
    staging_per_node: float = 0.0
    # grpo with rollout_backend vllm_protocol_cpu: the generator process on the node with rank 0 (weights, rollouts,
    # interpreter; counted in cpu_per_node); 0 otherwise
    generator_per_node: float = 0.0

    @property
    def setup_device(self) -> float:
        return self.setup.device


StateFn = Callable[["Context"], tuple[Components, float, Setup]]
CheckpointFn = Callable[["Context"], CheckpointShare]


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
