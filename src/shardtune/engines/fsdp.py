"""Fully sharded data parallel: torch FSDP2 (`fully_shard`) by default, FSDP1 when `fsdp_version: 1`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from shardtune.engines.base import OptimizerFactory, PrecisionSettings, SchedulerFactory
from shardtune.engines.checkpoint_writer import CheckpointWriter
from shardtune.engines.dcp_background import DcpBackground
from shardtune.engines.distributed import DistContext, DistributedMixin, gather_local_world_sizes
from shardtune.engines.engine_plan import FsdpSettings
from shardtune.engines.expert_parallel import ExpertPlacement, build_expert_mesh, clip_grad_norm_by_mesh, place_experts
from shardtune.engines.fsdp_config import DCP_DIR, FULL_STATE_FILE, fsdp1_strategy_member, reshards_after_forward
from shardtune.engines.fsdp_qlora import (
    drop_quant_state_entries,
    fsdp1_lora_units,
    layers_missing_quant_state,
    prepare_qlora_for_fsdp,
    quantized_layers,
    rank0_first,
    tensors_to_broadcast,
)
from shardtune.engines.fsdp_wrap import shard_fsdp2, wrap_targets
from shardtune.engines.safe_load import load_dcp_weights_only
from shardtune.engines.sharded_loading import ShardedLoad, fill_fully_sharded, fsdp1_param_init
from shardtune.engines.torch_native import SCHEDULER_FILE, TorchEngine
from shardtune.errors import ConfigError
from shardtune.model.adapter_files import save_lora_adapter
from shardtune.model.finetuning.lora import parametrized_lora_weights
from shardtune.model.fp8 import float8_all_gathers
from shardtune.model.moe import fsdp1_fused_lora_problem
from shardtune.model.saved import (
    as_saves_pretrained,
    expected_saved_parameters,
    share_tied_tensors,
    verify_saved,
    without_deepspeed_lookup,
)
from shardtune.optim.replacements import optimizer_parts
from shardtune.world import WorldLayout

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig
    from shardtune.engines.engine_plan import EnginePlan
    from shardtune.model.source import ModelSource



class FSDPEngine(DistributedMixin, TorchEngine):
    name = "fsdp"

    @classmethod
    def from_plan(cls, config: TrainConfig, plan: EnginePlan, ctx: DistContext,
                  precision: PrecisionSettings) -> FSDPEngine:
        return cls(plan.fsdp or FsdpSettings(), precision, ctx, config.expert_parallel_size)

    def __init__(self, settings: FsdpSettings, precision: PrecisionSettings, ctx: DistContext,
                 expert_parallel: int = 1) -> None:
        super().__init__(precision, ctx.device)
        self.ctx = ctx
        self.settings = settings
        self.mesh = build_mesh(settings, ctx)
        self.expert_mesh = build_expert_mesh(self.mesh.device_type, ctx.world_size, expert_parallel) \
            if expert_parallel > 1 else None
        self.experts: ExpertPlacement | None = None
        # FSDP shards gradients; torch's GradScaler cannot unscale them (validation refuses fp16 before launch).
        self.scaler = None
        self.quantized = False
        self.float8_all_gather = False  # fp8_enable_fsdp_float8_all_gather: scales computed after each step

    def build_model(self, source: ModelSource) -> torch.nn.Module:
        """An empty skeleton: ``prepare`` shards it first and then fills each rank's shard from the files.

        QLoRA is the exception: bitsandbytes quantises while loading, so each node's first rank loads the (4-bit,
        an eighth of fp32) model whole, then the others, and rank 0's copy is broadcast before sharding.
        """
        if source.quantization_bit is not None:
            with rank0_first(self.local_rank == 0, self.barrier):
                return source.load_full()
        skeleton = source.build_skeleton()
        self.loading = ShardedLoad.start(skeleton, self.device, self.rank, self.settings.cpu_ram_efficient_loading)
        return skeleton.model

    def prepare(self, model: torch.nn.Module, build_optimizer: OptimizerFactory,
                build_scheduler: SchedulerFactory) -> None:
        self.inner = model
        self.quantized = bool(quantized_layers(model))
        self.float8_all_gather = self.settings.version == 2 and float8_all_gathers(model)
        if self.quantized:
            prepare_qlora_for_fsdp(model, self.mixed_precision or torch.bfloat16)
        if self.loading is None:
            # A model loaded whole on every rank (QLoRA, tests, scripts): on the device first, so that the
            # broadcast below moves device tensors, as NCCL requires (offloading moves the shards back to the host).
            model.to(self.device)
            if self.settings.sync_module_states:
                broadcast_from_rank0(model)
        if self.settings.version == 2:
            if hasattr(model, "peft_config") and self.param_cast_dtype is not None:
                store_frozen_in_gather_dtype(model, self.param_cast_dtype)
            if self.expert_mesh is not None:
                self.experts = place_experts(model, self.expert_mesh)
            self.model = shard_fsdp2(model, self.settings, self.mesh, self.device, self.param_cast_dtype,
                                     self.expert_mesh)
            if self.loading is not None:
                fill_fully_sharded(self.model, self.loading, self.storage_device)
            settle_fsdp2_trainable(self.model)
        else:
            refuse_fsdp1_parametrized_lora(model)
            init = fsdp1_param_init(model, self.loading) if self.loading is not None else None
            self.model = wrap_fsdp1(model, self.settings, self.mesh, self.device, self.param_cast_dtype, init,
                                    extra_units=fsdp1_lora_units(model) if self.quantized else [])
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad])
        self.scheduler = build_scheduler(self.optimizer)

    @property
    def shards_weights(self) -> bool:
        return True

    def step_on_device(self, max_grad_norm: float) -> torch.Tensor:
        norm = super().step_on_device(max_grad_norm)
        if self.float8_all_gather:
            # torchao's float8 all-gather casts each weight shard with the scale of the whole weight: computed here
            # for every weight in one all-reduce, right after the update, instead of one per weight in the forward.
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)
        return norm

    def load_frozen(self, source: ModelSource) -> torch.nn.Module:
        """The frozen model sharded as the policy (its own ``fully_shard`` units, or FSDP1 wrap), filled from the
        files shard by shard, and gathered unit by unit for each forward: a strategy that keeps the gathered
        parameters for backward (SHARD_GRAD_OP) frees them after forward here, since no backward comes."""
        with torch.random.fork_rng(devices=[]):
            skeleton = source.build_skeleton()
        load = ShardedLoad.start(skeleton, self.device, self.rank, self.settings.cpu_ram_efficient_loading)
        model = skeleton.model
        model.requires_grad_(False)
        settings = frozen_fsdp_settings(self.settings)
        if settings.version == 2:
            if self.param_cast_dtype is not None:
                store_frozen_in_gather_dtype(model, self.param_cast_dtype)
            sharded = shard_fsdp2(model, settings, self.mesh, self.device, self.param_cast_dtype)
            fill_fully_sharded(sharded, load, self.storage_device)
        else:
            sharded = wrap_fsdp1(model, settings, self.mesh, self.device, self.param_cast_dtype,
                                 fsdp1_param_init(model, load))
        return sharded.eval()

    def forward_weight_dtype(self, stored: torch.dtype) -> torch.dtype:
        return self.param_cast_dtype or stored

    @property
    def storage_device(self) -> torch.device:
        """Where the sharded parameters live: the host when they are offloaded."""
        return torch.device("cpu") if self.settings.offload_params else self.device

    @property
    def mixed_precision(self) -> torch.dtype | None:
        """bf16 parameters in forward and backward, fp32 sharded master weights and gradient reductions."""
        return self.precision.autocast_dtype

    @property
    def param_cast_dtype(self) -> torch.dtype | None:
        """The dtype FSDP casts parameters to before gathering them; None keeps each parameter's own.

        QLoRA keeps its own dtypes: cast to bf16, the fp32 LoRA weights would leave the packed 4-bit weights the
        only dtype of their unit, which FSDP2 then gathers as floats (see ``fsdp_qlora``), and under FSDP1 the
        fp32 activations of bitsandbytes' layers would meet bf16 weights. Autocast does the bf16 compute instead,
        as in a single-process QLoRA run.
        """
        return None if self.quantized else self.mixed_precision

    def autocast(self) -> contextlib.AbstractContextManager:
        # FSDP's mixed-precision policy already runs the model in bf16; autocast on top would change the numerics.
        if self.quantized:
            return super().autocast()
        return contextlib.nullcontext()

    def generation_context(self) -> contextlib.AbstractContextManager:
        # generate() calls the wrapped module, not the FSDP1 root, so the root's own flat parameter (embeddings,
        # final norm, an untied output layer) is gathered here; the wrapped layers gather themselves.
        if self.settings.version == 1:
            return FullyShardedDataParallel.summon_full_params(self.model, recurse=False, writeback=False)
        # FSDP2: a LoRA root is peft's wrapper, whose forward generate skips, so its own weights are gathered here.
        root, gathered = self.fsdp2_root(), contextlib.ExitStack()
        root.unshard()
        gathered.callback(root.reshard)
        return gathered

    @contextlib.contextmanager
    def gathered_weights(self, params: list[torch.nn.Parameter]) -> Iterator[list[torch.Tensor]]:
        """FSDP2: ``full_tensor()`` of each sharded parameter (an all-gather each, in the order given). FSDP1's flat
        parameters gather by unit only (``summon_full_params``), not by parameter: not built."""
        if self.settings.version == 1:
            raise RuntimeError("engine fsdp1: gathering single weights (a generator's weight sync) is not built; "
                               "use FSDP2")
        yield [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]

    def accumulation_context(self, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        if self.settings.version == 2:
            root = self.fsdp2_root()
            if reshards_after_forward(self.settings.sharding_strategy):
                # FULL_SHARD / HYBRID_SHARD put memory first: every micro-batch reduce-scatters its gradients, so
                # only the shard accumulates (with sync off FSDP would keep the whole fp32 gradient on every rank:
                # 30 GiB for an 8B model), as torchtitan does. One reduce-scatter per micro-batch is the price.
                root.set_requires_gradient_sync(True)
            else:
                # The ZeRO-2-like strategies hold every gathered parameter from forward to backward anyway: they
                # accumulate unsharded and keep the parameters gathered until the window's last backward, which
                # costs them no peak memory and saves a reduce-scatter and an all-gather per unit per micro-batch.
                root.set_requires_gradient_sync(is_last_micro_batch)
                root.set_reshard_after_backward(is_last_micro_batch)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if is_last_micro_batch else self.fsdp1_root().no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self.settings.version == 1:
            return self.fsdp1_root().clip_grad_norm_(max_norm)
        if self.experts is not None:  # dense and expert weights live on different meshes
            return clip_grad_norm_by_mesh(self.iter_trainable(), max_norm)
        norm = torch.nn.utils.clip_grad_norm_(list(self.iter_trainable()), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def expert_parallel_report(self, steps: int) -> dict | None:
        if self.experts is None:
            return None
        return self.experts.summary(cast(list[dict], self.gather_objects(self.experts.report())), steps)

    def unwrapped_model(self) -> torch.nn.Module:
        return self.inner

    def fsdp2_root(self) -> FSDPModule:
        """The prepared model as the ``fully_shard`` root it is under FSDP2."""
        if not isinstance(self.model, FSDPModule):
            raise RuntimeError(f"engine fsdp2: model is {type(self.model).__name__}, not FSDPModule")
        return self.model

    def fsdp1_root(self) -> FullyShardedDataParallel:
        """The prepared model as the FullyShardedDataParallel wrapper it is under FSDP1."""
        if not isinstance(self.model, FullyShardedDataParallel):
            raise RuntimeError(f"engine fsdp1: model is {type(self.model).__name__}, not FullyShardedDataParallel")
        return self.model

    @property
    def wrapper_name(self) -> str:
        return "fully_shard" if self.settings.version == 2 else "FullyShardedDataParallel"

    def verify(self) -> None:
        expected = FSDPModule if self.settings.version == 2 else FullyShardedDataParallel
        lost = layers_missing_quant_state(self.inner)
        if lost:
            raise RuntimeError(f"engine fsdp: 4-bit layers lost their quantisation state when sharded: {lost[:3]}")
        if not isinstance(self.model, expected):
            raise RuntimeError(f"engine fsdp{self.settings.version}: model is {type(self.model).__name__}, "
                               f"not {expected.__name__}")
        if dist.get_world_size() != self.ctx.world_size:
            raise RuntimeError(f"engine fsdp: world size {dist.get_world_size()} != expected {self.ctx.world_size}")

    def full_state_options(self) -> StateDictOptions:
        """Unsharded tensors gathered into rank 0's host memory only; the other ranks receive empty dicts.

        torch ties rank-0-only to ``cpu_offload``. FSDP1 cannot take it on a CPU device: its offload assumes the
        compute device is not the host, and there ``.cpu()`` returns the tensor itself, so the model state reads
        storage FSDP1 just freed (storage size error or a crash) and the optimizer state comes back aliased
        (every moment equal to the last one gathered). On CPU the device is the host, so offloading saves no
        copy anyway: every rank gathers. FSDP1's NO_SHARD refuses offload (params are whole on every rank).
        """
        fsdp1_cannot_offload = self.settings.version == 1 and (
            self.device.type == "cpu" or self.settings.sharding_strategy == "NO_SHARD")
        return StateDictOptions(full_state_dict=True, cpu_offload=not fsdp1_cannot_offload)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on rank 0 (all ranks must call; the others may receive an empty dict)."""
        # An adapter run saves the adapter: gathering the frozen base too would rebuild the whole model.
        adapter_only = hasattr(self.inner, "peft_config")
        options = dataclasses.replace(self.full_state_options(), ignore_frozen_params=adapter_only)
        # full_state_dict=True gives plain tensors; torch's return type covers every option (DTensor, nested).
        return cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=options))

    def save_model(self, out_dir: Path) -> None:
        state = self.full_state_dict()
        if self.is_main:
            state = share_tied_tensors(self.inner, {k: v.detach().cpu() for k, v in state.items()})
            expected = expected_saved_parameters(self.inner, state)  # save_pretrained empties the dict it is given
            if hasattr(self.inner, "peft_config"):
                save_lora_adapter(self.inner, state, out_dir)
            else:
                with without_deepspeed_lookup():
                    as_saves_pretrained(self.inner).save_pretrained(out_dir, state_dict=state,
                                                                    safe_serialization=True)
            verify_saved(out_dir, expected)
        self.barrier()

    def save_state(self, ckpt_dir: Path, writer: CheckpointWriter | None = None) -> None:
        writer = writer or CheckpointWriter(background=False)
        if self.settings.state_dict_type == "FULL_STATE_DICT":
            model_sd, optim_sd = get_state_dict(self.model, optimizer_parts(self.optimizer),
                                                options=self.full_state_options())
            if self.is_main:
                writer.save_torch({"model": model_sd, "optim": optim_sd}, ckpt_dir / FULL_STATE_FILE)
        else:
            model_sd, optim_sd = self._sharded_state()
            state, folder = {"model": model_sd, "optim": optim_sd}, str(ckpt_dir / DCP_DIR)
            if writer.background:
                self._dcp_background = getattr(self, "_dcp_background", None) or DcpBackground(self.device)
                writer.follow(self._dcp_background.save(state, folder))
            else:
                dcp.save(state, checkpoint_id=folder)
        if self.is_main:
            writer.save_torch(self.scheduler_state(), ckpt_dir / SCHEDULER_FILE)

    def load_state(self, ckpt_dir: Path) -> None:
        if (ckpt_dir / FULL_STATE_FILE).is_file():
            self._load_full_state(ckpt_dir / FULL_STATE_FILE)
        else:
            model_sd, optim_sd = self._sharded_state()
            state = {"model": model_sd, "optim": optim_sd}
            load_dcp_weights_only(state, ckpt_dir / DCP_DIR)
            options = StateDictOptions(ignore_frozen_params=True, strict=False) if self.quantized else None
            set_state_dict(self.model, optimizer_parts(self.optimizer), model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=options)
        self.scheduler.load_state_dict(torch.load(ckpt_dir / SCHEDULER_FILE, map_location="cpu", weights_only=True))

    def _sharded_state(self) -> tuple[dict, dict]:
        """This rank's shards; QLoRA leaves out the frozen 4-bit base and bitsandbytes' quantisation-state entries,
        which the base model's files restore (FSDP1 refuses them on load)."""
        if not self.quantized:
            return get_state_dict(self.model, optimizer_parts(self.optimizer))
        model_sd, optim_sd = get_state_dict(self.model, optimizer_parts(self.optimizer),
                                            options=StateDictOptions(ignore_frozen_params=True))
        return drop_quant_state_entries(model_sd), optim_sd

    def _load_full_state(self, path: Path) -> None:
        """Only rank 0 reads the file (memory-mapped on its host); torch sends each tensor on to the others."""
        if self.is_main:
            full = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:
            full = {"model": {}, "optim": {}}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        # Two calls: set_state_dict treats an empty model dict (every rank but 0) as "optimizer only", and
        # those ranks would then skip the model's broadcasts that rank 0 waits in (seen with torch 2.13).
        set_optimizer_state_dict(self.model, optimizer_parts(self.optimizer), full["optim"], options=options)
        set_model_state_dict(self.model, full["model"], options=options)


def build_mesh(s: FsdpSettings, ctx: DistContext) -> DeviceMesh:
    """1-D shard mesh, or (replicate, shard) for hybrid strategies and for NO_SHARD under FSDP2."""
    device_type = "cpu" if ctx.backend == "gloo" else ctx.device.type  # gloo meshes are host meshes
    if s.is_hybrid:
        # From every rank's node size: a rank deciding from its own alone could differ from the others (uneven
        # placement) and leave them waiting in the mesh's first collective.
        layout = WorldLayout.of_placement(gather_local_world_sizes(ctx))
        try:
            shape = layout.hybrid_groups(s.sharding_strategy, s.hsdp_shard_size)
        except ValueError as err:
            raise ConfigError(f"fsdp: {err}") from None
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    if s.sharding_strategy == "NO_SHARD" and s.version == 2:
        return init_device_mesh(device_type, (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (ctx.world_size,), mesh_dim_names=("shard",))


def store_frozen_in_gather_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point parameters become ``dtype`` (bf16 under mixed precision) before FSDP2 shards them.

    FSDP2 casts every parameter of a unit to ``dtype`` before gathering it, so a frozen fp32 shard only ever
    served as the source of that cast: storing it cast gives the same gathered weights, with half the memory per
    rank and no cast before each gather. Trained parameters keep their fp32 shards (the master weights the
    optimizer updates). Only for runs that never save the frozen weights as a model (adapters; a reference model):
    a full or freeze run saves them, and the file's values rounded to bf16 would be saved in their place.
    """
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def settle_fsdp2_trainable(model: torch.nn.Module) -> None:
    """FSDP2 decides at its first forward which parameters are trained (their gradients then reach the weights' fp32
    dtype); decided now, while the training flags hold: a reference forward with the LoRA adapters off (dpo, ASFT),
    for which peft clears the adapters' requires_grad, would otherwise come first and leave bf16 gradients that FSDP
    cannot assign to the fp32 shards."""
    state = getattr(model, "_get_fsdp_state", None)
    if state is None or any(p.device.type == "meta" for p in model.parameters()):
        return  # weights still on the meta device (only a test's engine device) cannot be initialised
    state()._lazy_init()  # FSDP2 has no public call for its lazy initialisation


def frozen_fsdp_settings(s: FsdpSettings) -> FsdpSettings:
    """The policy's settings for a model that only runs forwards: parameters resharded after each unit's forward
    (the ZeRO-2-like strategies keep them gathered for a backward that never comes)."""
    resharding = {"SHARD_GRAD_OP": "FULL_SHARD", "HYBRID_SHARD_ZERO2": "HYBRID_SHARD"}
    return dataclasses.replace(s, sharding_strategy=resharding.get(s.sharding_strategy, s.sharding_strategy))


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Make every rank start from rank 0's weights and buffers (the model must already be on the engine's
    device: NCCL broadcasts device tensors only)."""
    with torch.no_grad():
        for tensor in tensors_to_broadcast(model):
            dist.broadcast(tensor, src=0)


def wrap_fsdp1(model: torch.nn.Module, s: FsdpSettings, mesh: DeviceMesh, device: torch.device,
               compute_dtype: torch.dtype | None = None,
               param_init_fn: Callable[[torch.nn.Module], None] | None = None,
               extra_units: list[torch.nn.Module] | None = None) -> torch.nn.Module:
    """FullyShardedDataParallel; ``param_init_fn`` fills a meta skeleton unit by unit while it is wrapped;
    ``extra_units`` get their own unit too (QLoRA: fp32 adapters apart from bf16 weights)."""
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    targets = {id(m) for m in [*wrap_targets(model, s), *(extra_units or [])]}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in targets) if targets else None
    prefetch = None if s.backward_prefetch == "NO_PREFETCH" else BackwardPrefetch[s.backward_prefetch]
    return FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy[fsdp1_strategy_member(s.sharding_strategy)],
        auto_wrap_policy=policy,
        cpu_offload=CPUOffload(offload_params=s.offload_params),
        backward_prefetch=prefetch,
        forward_prefetch=s.forward_prefetch,
        device_id=device,
        sync_module_states=False,  # the skeleton's loader or broadcast_from_rank0 already made ranks agree
        param_init_fn=param_init_fn,
        # Buffers (rotary frequencies) keep their dtype: they are not trained and bf16 would round them.
        mixed_precision=MixedPrecision(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype
        else None,
        use_orig_params=fsdp1_uses_orig_params(s, mesh, bool(extra_units)),
        device_mesh=mesh if s.is_hybrid else None,
    )


def refuse_fsdp1_parametrized_lora(model: torch.nn.Module) -> None:
    """LoRA on fused expert weights cannot train under FSDP1: peft re-registers its parametrization on every
    forward, which sets the weight onto itself in place, and FSDP1's weights are views split from one flat
    parameter, which autograd then refuses ("a view of a multi-output view modified inplace"). FSDP2 keeps each
    weight its own tensor."""
    adapted = parametrized_lora_weights(model)
    if adapted:
        raise ConfigError(fsdp1_fused_lora_problem(
            adapted[0] + (f" and {len(adapted) - 1} more" if len(adapted) > 1 else "")))


def fsdp1_uses_orig_params(s: FsdpSettings, mesh: DeviceMesh, has_frozen_units: bool) -> bool:
    """``use_orig_params``, unless it would lose the parameters of wholly frozen units.

    Unsharded (NO_SHARD, which FSDP1 also picks by itself on one process) with original parameters, FSDP1
    exposes a unit's parameters as plain tensors during forward and restores them in its post-backward hook,
    which never runs for a unit with nothing to train: its weights are then missing from every state dict
    (seen with QLoRA, whose decoder layers are frozen units beside the LoRA units). Flat parameters do not
    have this problem, and each of these units has one requires_grad value, which they need.
    """
    unsharded = s.sharding_strategy == "NO_SHARD" or mesh.size() == 1
    return s.use_orig_params and not (unsharded and has_frozen_units)
