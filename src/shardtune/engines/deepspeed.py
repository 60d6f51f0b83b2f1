"""DeepSpeed ZeRO 0-3 (with CPU offload) driven natively through ``deepspeed.initialize``.

The loop already divides each micro-batch loss by the token count of the whole window on all ranks, so this
engine never lets DeepSpeed divide by gradient_accumulation_steps again (``scale_wrt_gas=False``) and marks
the accumulation boundary itself on the last micro-batch of each window: the last window of an epoch may be
shorter than gradient_accumulation_steps, which DeepSpeed's own micro-step counter would get wrong.
The config arrives resolved (see ``deepspeed_config.build_deepspeed_config``): no "auto" left.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardtune.engines.base import Engine, OptimizerFactory, PrecisionSettings, SchedulerFactory
from shardtune.engines.checkpoint_writer import CheckpointWriter
from shardtune.engines.deepspeed_config import (
    CHECKPOINT_TAG,
    deepspeed_inputs,
    gathers_weights_on_save,
    has_own_optimizer,
    has_own_scheduler,
    offloads_optimizer,
    offloads_params,
    resolve_deepspeed_config,
    zero_shard_writers,
    zero_stage,
)
from shardtune.engines.distributed import DistContext, DistributedMixin
from shardtune.engines.safe_load import weights_only_loads
from shardtune.engines.sharded_loading import ShardedLoad, fill_zero3
from shardtune.errors import ConfigError
from shardtune.model.saved import (
    as_pretrained_model,
    as_saves_pretrained,
    expected_saved_parameters,
    saved_weights_problem,
)
from shardtune.optim.build import split_decay_groups
from shardtune.versions import current_collectives
from shardtune.world import WorldLayout

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig
    from shardtune.engines.engine_plan import EnginePlan
    from shardtune.model.source import ModelSource

UNIVERSAL_TAG = "deepspeed_universal"


class DeepSpeedEngine(DistributedMixin, Engine):
    """One DeepSpeedEngine per process; the loop only sees the Engine interface."""

    name = "deepspeed"

    @classmethod
    def from_plan(cls, config: TrainConfig, plan: EnginePlan, ctx: DistContext,
                  precision: PrecisionSettings) -> DeepSpeedEngine:
        """The config resolved against this job's world (DeepSpeed's "auto" values, the batch arithmetic)."""
        if ctx.device.type == "cuda" and ctx.device.index != ctx.local_rank:
            # DeepSpeed (ZeRO-3's partitioning among others) puts tensors on the GPU numbered LOCAL_RANK itself.
            raise ConfigError(f"deepspeed: this rank (LOCAL_RANK={ctx.local_rank}) was given one GPU, and DeepSpeed "
                              "always takes the GPU numbered LOCAL_RANK: give each process all of the node's GPUs "
                              "(one shardtune per node, e.g. srun --ntasks-per-node=1 --gpus-per-node=N)")
        layout = WorldLayout.of_ranks(ctx.world_size, ctx.local_world_size, config.per_device_train_batch_size,
                                      config.gradient_accumulation_steps)
        return cls(resolve_deepspeed_config(plan.deepspeed_raw or {}, deepspeed_inputs(config, layout)), precision,
                   ctx)

    def __init__(self, ds_config: dict, precision: PrecisionSettings, ctx: DistContext) -> None:
        super().__init__(precision, ctx.device)
        self.ctx = ctx
        self.ds_config = ds_config
        self.ds: Any = None  # deepspeed.runtime.engine.DeepSpeedEngine once prepared
        self.frozen: list[Any] = []  # optimizer-less DeepSpeed engines of frozen models (load_frozen)
        self._boundary_marked = False

    # --- topology ---
    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    @property
    def loss_scale_for_mean_reduction(self) -> float:
        # DeepSpeed averages gradients over data-parallel ranks unless gradient_allreduce_op is "sum".
        if self.ds is not None:
            averages = bool(self.ds.gradient_average)
        else:
            averages = self.ds_config.get("gradient_allreduce_op", "mean") == "mean"
        return float(self.world_size) if averages else 1.0

    @property
    def is_peft(self) -> bool:
        return hasattr(self.unwrapped_model(), "peft_config")

    # --- setup ---
    def build_model(self, source: ModelSource) -> torch.nn.Module:
        """ZeRO-3: the model is built partitioned (``zero.Init``) and filled one gathered parameter at a time,
        rank 0 reading the files; below ZeRO-3 every rank holds the whole model anyway."""
        if self.zero_stage != 3 or source.quantization_bit is not None:
            return source.load_full()
        skeleton = source.build_skeleton(construction=self._partitioned_construction(self.ds_config))
        self.loading = ShardedLoad.start(skeleton, self.device, self.rank, rank0_reads=True)
        fill_zero3(skeleton.model, self.loading)
        return skeleton.model

    @property
    def shards_weights(self) -> bool:
        return self.zero_stage == 3

    def load_frozen(self, source: ModelSource) -> torch.nn.Module:
        """ZeRO-3: a second DeepSpeed engine, partitioned as the policy and without optimizer (DeepSpeed then only
        gathers each module's parameters for its forward and frees them after), built and filled the way the
        policy is; below ZeRO-3 a replica, as the policy is one."""
        if self.zero_stage != 3:
            return super().load_frozen(source)
        deepspeed = self._deepspeed()

        config = frozen_zero3_config(self.ds_config)
        with torch.random.fork_rng(devices=[]):
            skeleton = source.build_skeleton(construction=self._partitioned_construction(config))
        fill_zero3(skeleton.model, ShardedLoad.start(skeleton, self.device, self.rank, rank0_reads=True))
        model = skeleton.model
        model.requires_grad_(False)
        apply_zero3_moe_leaves(model)
        frozen, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
        frozen.eval()  # DeepSpeed's eval() returns nothing
        self.frozen.append(frozen)
        return frozen

    @contextlib.contextmanager
    def _partitioned_construction(self, ds_config: dict) -> Iterator[None]:
        """Entered only where the model is constructed: zero.Init replaces torch.Tensor.__new__, and a module first
        imported under it (transformers.modeling_utils -> torch._dynamo, reached first inside the construction of
        Qwen3 and Qwen3-MoE models) fails its signature check; so it is imported before."""
        # zero.Init sizes partitions by DeepSpeed's view of the world: join the existing process group first.
        deepspeed = self._deepspeed()
        import transformers.modeling_utils  # noqa: F401
        from transformers.integrations.deepspeed import prevent_arange_dtype_change

        # Must come first: zero.Init would otherwise cast the rotary frequencies' arange to the training dtype.
        with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=ds_config):
            yield

    def _deepspeed(self) -> Any:
        """The deepspeed module, joined to this run's process group (``deepspeed.initialize`` would join it too,
        after its first collectives are set up) with torch's current names of its collectives."""
        deepspeed = deepspeed_for_training(self.device)
        deepspeed.init_distributed(dist_backend=self.ctx.backend, dist_init_required=False)
        use_current_collective_names(deepspeed.comm.comm.cdb)
        return deepspeed

    def prepare(self, model: torch.nn.Module, build_optimizer: OptimizerFactory,
                build_scheduler: SchedulerFactory) -> None:
        deepspeed = self._deepspeed()

        trainable = [p for p in model.parameters() if p.requires_grad]
        params: list[torch.nn.Parameter] | list[dict[str, Any]]
        if has_own_optimizer(self.ds_config):
            # DeepSpeed builds the JSON's optimizer; the groups keep our rule of no decay on biases and norms.
            decay = self.ds_config["optimizer"].get("params", {}).get("weight_decay", 0.0)
            optimizer, params = None, split_decay_groups(trainable, decay)
        else:
            optimizer, params = self._client_optimizer(trainable, build_optimizer), trainable
        # A callable: DeepSpeed calls it with the optimizer it steps (ours, or the one its JSON describes).
        scheduler = None if has_own_scheduler(self.ds_config) else build_scheduler
        if self.zero_stage == 3:
            leaves = apply_zero3_moe_leaves(model)
            if leaves and self.is_main:
                print(f"[shardtune] ZeRO-3: modules gathered whole ({', '.join(leaves)}), so ranks whose tokens take "
                      "different branches (experts, long-row compressors) run the same collectives", flush=True)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=params, lr_scheduler=scheduler,
            config=self.ds_config, dist_init_required=False)
        self.model = self.ds

    def _client_optimizer(self, params: list[torch.nn.Parameter],
                          build_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        optimizer = build_optimizer(params)
        if not offloads_optimizer(self.ds_config) or self.ds_config.get("zero_force_ds_cpu_optimizer") is False:
            return optimizer
        return to_cpu_adam(optimizer)

    def verify(self) -> None:
        """Fail loudly when DeepSpeed set up something other than what the config asked for."""
        from deepspeed.runtime.engine import DeepSpeedEngine as DSEngine

        if not isinstance(self.ds, DSEngine):
            raise RuntimeError(f"deepspeed engine: expected a DeepSpeedEngine after prepare, got {type(self.ds)}")
        wrong = [f"{what}: asked {asked}, got {got}" for what, asked, got in self._setup_facts() if asked != got]
        if wrong:
            raise RuntimeError("deepspeed engine set up differently than configured: " + "; ".join(wrong))

    def _setup_facts(self) -> list[tuple[str, Any, Any]]:
        ds, cfg = self.ds, self.ds_config
        return [
            ("ZeRO stage", self.zero_stage, int(ds.zero_optimization_stage())),
            ("world size", self.ctx.world_size, dist.get_world_size()),
            ("data-parallel world size", self.ctx.world_size, int(ds.dp_world_size)),
            ("train_batch_size", cfg["train_batch_size"], ds.train_batch_size()),
            ("gradient_accumulation_steps", cfg["gradient_accumulation_steps"], ds.gradient_accumulation_steps()),
            ("bf16", self.precision.bf16, bool(ds.bfloat16_enabled())),
            ("fp16", self.precision.fp16, bool(ds.fp16_enabled())),
            ("optimizer offload", offloads_optimizer(cfg), bool(ds.zero_cpu_offload())),
            ("parameter offload", offloads_params(cfg), bool(ds.zero_offload_param())),
        ]

    # --- per step ---
    def autocast(self) -> contextlib.AbstractContextManager:
        # DeepSpeed casts the module to bf16/fp16 itself; torch autocast on top would change the numerics.
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def accumulation_context(self, is_last_micro_batch: bool) -> Iterator[None]:
        # The boundary stays set for the backward that follows the forward run in this context: DeepSpeed
        # reduces (ZeRO 0/1) or finalises (ZeRO 2/3) the accumulated gradients when it is True.
        self.ds.set_gradient_accumulation_boundary(is_last_micro_batch)
        self._boundary_marked = is_last_micro_batch
        yield

    def backward(self, loss: torch.Tensor) -> None:
        # The loop's loss is already normalised over the whole window: no division by accumulation steps.
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self, max_grad_norm: float) -> float:
        """DeepSpeed clips (gradient_clipping), steps optimizer and scheduler, and zeroes the gradients."""
        if not self._boundary_marked:
            raise RuntimeError("deepspeed engine: step() before a backward at an accumulation boundary; "
                               "run the last micro-batch inside accumulation_context(is_last_micro_batch=True)")
        clipping = float(self.ds.gradient_clipping())
        if clipping != float(max(max_grad_norm, 0.0)):
            raise RuntimeError(f"deepspeed engine: config gradient_clipping ({clipping}) differs from "
                               f"max_grad_norm ({max_grad_norm}) the loop uses")
        local_norm = self._plain_optimizer_grad_norm()
        self.ds.step()
        self._boundary_marked = False
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            norm = local_norm
        return float(norm) if norm is not None else 0.0

    def _plain_optimizer_grad_norm(self) -> float | None:
        """The norm DeepSpeed does not report when it steps a bare torch optimizer (ZeRO-0 in fp32)."""
        if hasattr(self.ds.optimizer, "_global_grad_norm"):
            return None
        grads = [p.grad for p in self.ds.module.parameters() if p.grad is not None]
        # At the boundary the gradients are already averaged over ranks, so the local norm is the global one.
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    @contextlib.contextmanager
    def gathered_weights(self, params: list[torch.nn.Parameter]) -> Iterator[list[torch.Tensor]]:
        """ZeRO-3: ``GatheredParameters`` on these parameters alone (read-only, re-partitioned on exit)."""
        if self.zero_stage != 3:
            yield [p.detach() for p in params]
            return
        with self._deepspeed().zero.GatheredParameters(params, modifier_rank=None):
            yield [p.data for p in params]

    def current_lr(self) -> float:
        return float(self.ds.get_lr()[0])

    # --- saving ---
    def unwrapped_model(self) -> torch.nn.Module:
        return self.ds.module

    def save_model(self, out_dir: Path) -> None:
        """Hugging Face format with safetensors on rank 0; under ZeRO-3 every rank takes part in the gather."""
        model = self.unwrapped_model()
        expected = expected_saved_parameters(model)
        if self.zero_stage == 3 and not self.is_peft and not gathers_weights_on_save(self.ds_config):
            self._save_zero3_streamed(model, out_dir)
        else:
            state_dict = self._full_state_dict(adapter_only=self.is_peft)
            if self.is_main:
                out_dir.mkdir(parents=True, exist_ok=True)
                # peft would add whole embedding layers once the vocabulary grew; modules_to_save already holds them.
                extra = {"save_embedding_layers": False} if self.is_peft else {}
                as_saves_pretrained(model).save_pretrained(str(out_dir), state_dict=state_dict, **extra)
        error = saved_weights_problem(out_dir, expected) if self.is_main else None
        error = self._broadcast_from_main(error)
        if error:
            raise RuntimeError(error)

    def _save_zero3_streamed(self, model: torch.nn.Module, out_dir: Path) -> None:
        """``stage3_gather_16bit_weights_on_model_save: false``: no consolidated state dict on rank 0; each module
        is gathered in turn and rank 0 writes the safetensors shards as they fill (an adapter is small: it takes
        the consolidated path)."""
        from shardtune.engines.deepspeed_save import write_model_streamed, zero3_module_states

        states = zero3_module_states(model, self.is_main)
        if not self.is_main:
            for _ in states:  # join every module's gather
                pass
            return
        print("[shardtune] ZeRO-3 without stage3_gather_16bit_weights_on_model_save: writing the model one "
              "gathered module at a time", flush=True)
        write_model_streamed(as_pretrained_model(model), states, out_dir)

    def _full_state_dict(self, adapter_only: bool) -> dict[str, torch.Tensor] | None:
        """Complete tensors on rank 0 (None elsewhere under ZeRO-3); trainable ones only for an adapter."""
        if self.zero_stage == 3:
            # Collective: gathers one module at a time onto rank 0. On CPU .cpu() returns the very storage
            # DeepSpeed frees when it re-partitions, so the data is cloned there; from a GPU it is a copy already.
            state = self.ds._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=adapter_only)
            if state is not None and self.device.type == "cpu":
                state = copies_keeping_ties(state)
            return state
        if not self.is_main:
            return None  # below ZeRO-3 every rank holds the full weights: nothing to gather
        model = self.unwrapped_model()
        if adapter_only:
            return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return copies_keeping_ties(model.state_dict())

    def _broadcast_from_main(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def save_state(self, ckpt_dir: Path, writer: CheckpointWriter | None = None) -> None:
        """All ranks write their shards through ``writer`` (deepspeed_checkpoint.py); LoRA leaves the frozen base out.

        The (empty) universal-checkpoint info lets ``ds_to_universal`` convert the shards later, which is how a
        checkpoint resumes on a different number of processes.
        """
        from shardtune.engines.deepspeed_checkpoint import writing_through

        with writing_through(self.ds, writer or CheckpointWriter(background=False)):
            self.ds.save_checkpoint(str(ckpt_dir), tag=CHECKPOINT_TAG, exclude_frozen_parameters=self.is_peft,
                                    client_state={"universal_checkpoint_info": {}})

    def load_state(self, ckpt_dir: Path) -> None:
        tag = CHECKPOINT_TAG
        writers = zero_shard_writers(ckpt_dir / CHECKPOINT_TAG)
        if writers and writers != self.world_size:
            if self.zero_stage != 3:
                self._load_resharded_zero12(ckpt_dir, writers)
                return
            tag = self._convert_to_universal(ckpt_dir, writers)
        with weights_only_loads():
            path, _ = self.ds.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=not self.is_peft,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"deepspeed engine: no DeepSpeed state (tag {tag}) in {ckpt_dir}")

    def _load_resharded_zero12(self, ckpt_dir: Path, writers: int) -> None:
        """Module weights and scheduler through DeepSpeed; fp32 weights and Adam moments re-split by us, each rank
        reading only its own slices of the old shards."""
        from shardtune.engines.deepspeed_reshard import restore_partitions

        if self.is_main:
            print(f"[shardtune] checkpoint written by {writers} processes, resuming on {self.world_size}: "
                  f"re-splitting its ZeRO-{self.zero_stage} optimizer state", flush=True)
        with weights_only_loads():
            path, _ = self.ds.load_checkpoint(str(ckpt_dir), tag=CHECKPOINT_TAG, load_module_strict=not self.is_peft,
                                              load_optimizer_states=False, load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"deepspeed engine: no DeepSpeed state (tag {CHECKPOINT_TAG}) in {ckpt_dir}")
        missing = restore_partitions(self.ds, ckpt_dir / CHECKPOINT_TAG, self.rank, self.world_size)
        if missing:
            raise RuntimeError(f"deepspeed engine: checkpoint {ckpt_dir} has no optimizer state for {missing[:3]}")

    def _convert_to_universal(self, ckpt_dir: Path, writers: int) -> str:
        """ZeRO shards are tied to the world size that wrote them; DeepSpeed's universal format is not."""
        universal = ckpt_dir / UNIVERSAL_TAG
        if self.is_main and not (universal / "zero").is_dir():
            print(f"[shardtune] checkpoint written by {writers} processes, resuming on {self.world_size}: "
                  f"converting to DeepSpeed's universal checkpoint in {universal}", flush=True)
            from shardtune.engines.deepspeed_checkpoint import convert_to_universal

            convert_to_universal(ckpt_dir / CHECKPOINT_TAG, universal)
        self.barrier()
        self.ds._config.load_universal_checkpoint = True  # read by load_checkpoint; initialize() set it False
        return UNIVERSAL_TAG

    def destroy(self) -> None:
        """Release DeepSpeed's hooks and buffers but keep the process group (e.g. to set up another engine)."""
        for frozen in self.frozen:
            frozen.destroy()
        self.frozen = []
        if self.ds is not None:
            self.ds.destroy()
            self.ds = None

    def close(self) -> None:
        self.destroy()
        super().close()


def deepspeed_for_training(device: torch.device | None = None) -> Any:
    """The deepspeed module, told the ``device`` the ranks train on and, on a CPU machine, not to build its
    shared-memory all-reduce op.

    Why the device: without ``DS_ACCELERATOR`` DeepSpeed guesses its accelerator when first imported and, finding no
    GPU, warns on every rank that it was "unable to detect" one. A rank training on the host has its tensors there,
    so DeepSpeed's accelerator is the CPU: said before the import rather than guessed (a value the user set stays).

    Why: DeepSpeed's communication backend compiles that C++ op the first time a process group starts on a CPU
    machine (48 s on 2 cores, with a compiler on the host), for its inference all-reduce of tensor-parallel
    inference, which training never calls; its collectives go through torch.distributed either way. Its list of
    buildable ops is one dict per process (``deepspeed.ops.__compatible_ops__``), so marking the op there is what
    its ``build_shm_op`` reads.
    """
    if device is not None and device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def use_current_collective_names(backend: Any) -> None:
    """Point DeepSpeed's communication ``backend`` at torch's current names of ZeRO's two sharding collectives.

    DeepSpeed (0.19) looks up ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` once and calls them for every
    gather and gradient reduction; torch 2.13 renamed them ``all_gather_single`` and ``reduce_scatter_single`` (the
    old names call the new ones, with the same arguments) and warns on every call, on every rank. Where torch has
    only the old names, or DeepSpeed no such attributes, nothing changes.
    """
    current = current_collectives(dist)
    attributes = {"all_gather_function": "all_gather_into_tensor", "reduce_scatter_function": "reduce_scatter_tensor"}
    for attribute, old in attributes.items():
        if getattr(backend, attribute, None) is not None and old in current:
            setattr(backend, attribute, current[old])


def apply_zero3_moe_leaves(model: torch.nn.Module) -> list[str]:
    """Register the model's sparse MoE blocks (and modules only long rows reach) as ZeRO-3 leaf modules; returns
    their class names.

    ZeRO-3 gathers a module's parameters in hooks as each submodule runs and prefetches by the recorded order;
    inside an MoE block the experts that run depend on the routing, so two ranks with different tokens would issue
    different all-gathers and wait on each other forever. A leaf block is gathered whole on entry instead. The
    block classes are found from the model (a module owning experts and a router), not from a table. A module
    whose weights only long rows reach, or that calls a submodule as many times as its rows say
    (model/length_dependent.py), is a leaf for the same reason (and the first so that its output hook sees all its
    weights gathered).
    """
    from deepspeed.utils import set_z3_leaf_modules

    from shardtune.model.length_dependent import zero3_whole_classes
    from shardtune.model.moe import sparse_moe_block_classes

    classes = [*sparse_moe_block_classes(model), *zero3_whole_classes(model)]
    if classes:
        set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]


def frozen_zero3_config(ds_config: dict) -> dict:
    """The policy's resolved ZeRO-3 config for a model that is never trained: no optimizer, scheduler or optimizer
    offload (DeepSpeed builds no optimizer then and keeps only the parameter partitioning); the partitioning,
    parameter offload and precision stay the policy's, so the frozen model is placed and computes as it does."""
    config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    config["zero_optimization"] = {k: v for k, v in ds_config.get("zero_optimization", {}).items()
                                   if k != "offload_optimizer"}
    return config


def to_cpu_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same Adam(W) as DeepSpeedCPUAdam, which ZeRO-Offload needs: same param groups and hyper-parameters."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ConfigError(f"zero_optimization.offload_optimizer needs an Adam optimizer (DeepSpeedCPUAdam); "
                          f"got {type(optimizer).__name__}: use optim adamw_torch")
    defaults = optimizer.defaults
    if defaults.get("amsgrad"):
        raise ConfigError("zero_optimization.offload_optimizer: DeepSpeedCPUAdam has no amsgrad")
    adamw = isinstance(optimizer, torch.optim.AdamW) or bool(defaults.get("decoupled_weight_decay"))
    groups = [{"params": g["params"], "lr": g["lr"], "betas": g["betas"], "eps": g["eps"],
               "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
                            weight_decay=defaults["weight_decay"], adamw_mode=adamw)


def copies_keeping_ties(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies of a state dict in which names that shared a tensor still share one copy.

    ``save_pretrained`` drops the output layer of a tied model only when it is the embedding's very tensor;
    copied apart, both would be written (a 0.5B Qwen2 saved 630M elements for its 494M).
    """
    copies: dict[tuple[int, int | torch.SymInt, torch.Size], torch.Tensor] = {}
    return {name: copies.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), t.shape),
                                    t.detach().clone()) if t.numel() else t.detach().clone()
            for name, t in state.items()}

