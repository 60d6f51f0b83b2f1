"""The memory model applied to a TrainConfig: what `train` (engine: auto), `check` and the workflow call."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from shardtune.config.adapter_method import adapter_targets
from shardtune.config.preference import PREFERENCE_STAGES, holds_reference_copy
from shardtune.config.schema import TrainConfig
from shardtune.data.settings import takes_offsets
from shardtune.engines.engine_plan import EnginePlan
from shardtune.engines.plan import plan_engine, spec_for
from shardtune.errors import ConfigError, ShardtuneError
from shardtune.estimate.compare import RunMemoryEstimate, run_memory_estimate
from shardtune.estimate.hardware import Hardware, format_size
from shardtune.estimate.options import OPTION_SPECS, build_option, build_options, fsdp_states
from shardtune.estimate.parts import Components, Context, Option, Setup, StateFn
from shardtune.estimate.recommend import recommend
from shardtune.estimate.shape import ModelShape, load_model_shape
from shardtune.estimate.workload import Workload
from shardtune.estimate.zero import zero_settings, zero_states
from shardtune.model.finetuning.oft import OftSettings
from shardtune.model.finetuning.settings import FrozenParts
from shardtune.world import WorldLayout

if TYPE_CHECKING:
    from shardtune.engines.engine_plan import FsdpSettings

# Images per sample when the data has an images column: the estimate reads dataset_info.json, not the records, so it
# assumes one image per sample (each at image_max_pixels); the report says so.
IMAGES_PER_SAMPLE = 1


def model_shape_for(c: TrainConfig, model_config: str | None = None) -> ModelShape:
    """The shape of the model the run trains: config.json's, under a one-row score head for stage rm."""
    shape = load_model_shape(c.model_name_or_path, model_config)
    return shape.as_reward_model() if c.stage == "rm" else shape


def workload_from_config(c: TrainConfig) -> Workload:
    """The estimate's view of a config: micro batch x cutoff_len tokens per device (the longest batch; under token
    budgets ``micro_batch_rows``; cutoff_len / sequence_parallel_size of them computed per rank under sequence
    parallelism); a dpo/kto/rm micro-batch runs two rows per sample in one forward from the full logits
    (loss_chunk_size does not apply) and a dpo/kto run, or a grpo run with beta > 0, may hold a frozen reference
    (``holds_reference_copy``). A grpo micro-batch is one group: num_generations rows of cutoff_len tokens (prompt
    + max_completion_length), and its rollouts are estimated apart (estimate/grpo.py). Data with an images column is
    read as ``IMAGES_PER_SAMPLE`` images per sample, each at image_max_pixels. BAdam (``use_badam``) trains one
    decoder layer at a time: it is estimated as freeze tuning of the first layer, the block whose backward runs
    through every layer above it (the largest activation footprint of its blocks)."""
    finetuning = "qlora" if c.finetuning_type == "lora" and c.quantization_bit is not None else c.finetuning_type
    if c.use_badam:
        finetuning = "freeze"
        c = dataclasses.replace(c, freeze_trainable_layers=-1, freeze_trainable_modules=["all"])
    preference = c.stage in PREFERENCE_STAGES
    grpo = c.stage == "grpo"
    # grpo runs one group (num_generations rows of prompt + completion, within cutoff_len) per forward
    micro_batch, seq_len = (c.num_generations, c.cutoff_len) if grpo else micro_batch_rows(c)
    return Workload(
        micro_batch=micro_batch,
        seq_len=seq_len,
        precision="bf16" if c.bf16 else ("fp16" if c.fp16 else "fp32"),
        finetuning_type=finetuning,
        gradient_checkpointing=c.gradient_checkpointing,
        lora_rank=c.lora_rank,
        use_dora=c.use_dora,
        lora_targets=tuple(adapter_targets(c)[1]),
        oft=OftSettings(c.oft_rank, c.oft_block_size, c.module_dropout),
        freeze_trainable_layers=c.freeze_trainable_layers,
        freeze_trainable_modules=tuple(c.freeze_trainable_modules),
        quantization_bit=c.quantization_bit,
        attn_implementation=c.attn_implementation,
        optim=c.optim,
        gradient_accumulation_steps=c.gradient_accumulation_steps,
        loss_chunk_size=0 if preference or grpo else c.loss_chunk_size,
        rows_per_sample=2 if preference else 1,
        reference_copy=holds_reference_copy(c),
        sequence_parallel=c.sequence_parallel_size,
        sequence_parallel_mode=c.sequence_parallel_mode,
        expert_parallel=c.expert_parallel_size,
        dense_mask=not concatenated_rows(c),
        frozen_parts=FrozenParts(c.freeze_vision_tower, c.freeze_multi_modal_projector, c.freeze_language_model),
        images_per_sample=IMAGES_PER_SAMPLE if data_has_images(c) else 0,
        image_max_pixels=c.image_max_pixels,
        async_save=c.async_save,
        completion_tokens=c.max_completion_length if grpo else 0,
        external_generator=grpo and c.rollout_backend == "vllm_protocol_cpu",
    )


def micro_batch_rows(c: TrainConfig) -> tuple[int, int]:
    """Rows x tokens of the largest micro-batch. Under ``micro_batch_tokens`` (B): with padding-free rows (asked for,
    or left to the default under a kernel that takes offsets: flash, varlen) one row of B tokens; padded, rows of
    cutoff_len, as many as B slots need (rounded up: at most one row more than a budget that is not a multiple of
    cutoff_len holds)."""
    budget = c.micro_batch_tokens
    if not budget:
        return c.per_device_train_batch_size, c.cutoff_len
    padding_free = c.padding_free if c.padding_free is not None else takes_offsets(c.attn_implementation)
    if padding_free:
        return 1, budget
    return -(-budget // c.cutoff_len), c.cutoff_len


def data_has_images(c: TrainConfig) -> bool:
    """Whether a training dataset maps an images column in dataset_info.json (neither the records nor the images are
    read, and need not be on this machine; a registry that cannot be read counts as none: the checks name it)."""
    from shardtune.data.registry import load_registry

    if not c.dataset:
        return False
    registry, _ = load_registry(c.dataset_dir)
    entries = [registry.get(name) for name in c.dataset]
    return any(isinstance(entry, dict) and "images" in (entry.get("columns") or {}) for entry in entries)


def concatenated_rows(c: TrainConfig) -> bool:
    """pt with packing: texts concatenated and cut into full rows, which attend causally without a mask."""
    from shardtune.data.settings import resolved_packing

    return c.stage == "pt" and resolved_packing(c) and not c.neat_packing


def options_for_config(c: TrainConfig, hardware: Hardware, model_config: str | None = None) -> list[Option]:
    """Every engine option for this config on ``hardware``, fastest first."""
    shape = model_shape_for(c, model_config)
    return build_options(shape, workload_from_config(c), hardware)


def recommend_for_config(config: TrainConfig, world_size: int, nproc_per_node: int, gpu_memory_bytes: int | None,
                         cpu_memory_bytes: int) -> tuple[dict[str, Any], str]:
    """Config values that select the fastest engine option that fits, and why (for `engine: auto`).

    The values are meant for a config with neither ``deepspeed`` nor ``fsdp`` set: {} means DDP (or one
    process). ``gpu_memory_bytes`` None means the ranks run on the CPU. When no option fits whole rows, the
    smallest sequence split that makes one fit (``split_to_fit``). Raises ConfigError when nothing fits.
    """
    hardware = hardware_for(world_size, nproc_per_node, gpu_memory_bytes, cpu_memory_bytes)
    result = recommend(options_for_config(config, hardware), hardware, workload_from_config(config))
    if result.option is None:
        split = split_to_fit(config, hardware)
        if split is None:
            raise ConfigError(f"engine (auto): {result.reason}")
        return split
    return dict(result.option.engine_values), result.reason


def split_to_fit(config: TrainConfig, hardware: Hardware) -> tuple[dict[str, Any], str] | None:
    """The values of the smallest ``sequence_parallel_size`` (a divisor of the ranks per node, so a row stays on one
    node) with which an engine option fits, for a run that splits no rows yet and could; None when none does."""
    from shardtune.engines.sequence_parallel_plan import sequence_parallel_problems

    if config.sequence_parallel_size > 1:
        return None
    per_node = hardware.gpus_per_node
    for size in (n for n in range(2, per_node + 1) if per_node % n == 0):
        split = dataclasses.replace(config, sequence_parallel_size=size)
        if sequence_parallel_problems(split):
            return None  # the model or the run cannot be split, at any size
        result = recommend(options_for_config(split, hardware), hardware, workload_from_config(split))
        if result.option is not None:
            values = {**result.option.engine_values, "sequence_parallel_size": size}
            return values, (f"no option fits rows of {config.cutoff_len} tokens whole; split over {size} ranks "
                            f"(sequence_parallel_size: {size}): {result.reason}")
    return None


def hardware_for(world_size: int, nproc_per_node: int, gpu_memory_bytes: int | None,
                 cpu_memory_bytes: int) -> Hardware:
    """The launch as the estimate sees it: nodes x ranks per node, memory per GPU (None: CPU ranks) and node."""
    layout = WorldLayout.of_ranks(world_size, nproc_per_node)
    return Hardware(nodes=layout.nodes, gpus_per_node=layout.procs_per_node, gpu_memory=gpu_memory_bytes,
                    cpu_memory=cpu_memory_bytes)


def configured_option(config: TrainConfig, hardware: Hardware, shape: ModelShape | None = None,
                      engine: EnginePlan | None = None) -> Option:
    """The option the run's engine selects, as the engines plan it (a DeepSpeed preset or JSON; fsdp words, an
    fsdp_config mapping, file or accelerate config file; else DDP). ``engine``: the plan preflight made."""
    shape = shape or model_shape_for(config)
    if engine is None:
        engine, _ = plan_engine(config, hardware.world_size, has_cuda=hardware.on_gpu)  # problems: preflight's job
    c = Context(shape, workload_from_config(config), hardware)
    name, states = _engine_states(engine, c)
    spec = next(s for s in OPTION_SPECS if s.name == name)
    return build_option(dataclasses.replace(spec, states=states), c)


def _engine_states(engine: EnginePlan, c: Context) -> tuple[str, StateFn]:
    """The estimate's option name and memory model for an engine plan, from the engine's own record."""
    layout = spec_for(engine.kind).memory_layout(engine)
    if layout.family == "deepspeed":
        z = zero_settings(engine.deepspeed_raw or {}, c.shape.hidden_size)
        return layout.option, lambda ctx: zero_states(ctx, z)
    if layout.family == "fsdp":
        group = (layout.shard_group or c.hardware.gpus_per_node) if layout.hybrid else c.ranks
        return layout.option, lambda ctx: fsdp_states(ctx, group, reshard=layout.reshard_after_forward,
                                                      offload=layout.offload)
    return layout.option, OPTION_SPECS[0].states


def fit_warning(config: TrainConfig, world_size: int, nproc_per_node: int, gpu_memory_bytes: int | None,
                cpu_memory_bytes: int, engine: EnginePlan | None = None) -> str | None:
    """One line when the configured engine is estimated not to fit (for `shardtune check`), else None."""
    hardware = hardware_for(world_size, nproc_per_node, gpu_memory_bytes, cpu_memory_bytes)
    try:
        option = configured_option(config, hardware, engine=engine)
    except ShardtuneError:
        return None  # an unreadable model shape is reported by the other checks
    if option.fits or not option.available:
        return None
    workload = workload_from_config(config)
    best = recommend(build_options(model_shape_for(config), workload, hardware), hardware,
                     workload)
    hint = f"; {best.option.name} would fit ({_values(best.option)})" if best.option else f"; {best.reason}"
    need = (f"{format_size(option.device_peak)} per GPU of {format_size(gpu_memory_bytes)}"
            if gpu_memory_bytes is not None  # hardware.on_gpu, spelled so that the type checker narrows
            else f"{format_size(option.cpu_per_node)} of {format_size(cpu_memory_bytes)} CPU memory")
    return f"memory: {option.name} is estimated to need {need}{hint}"


def _values(option: Option) -> str:
    return ", ".join(f"{k}: {v}" for k, v in option.engine_values.items()) or "no deepspeed/fsdp setting"


def estimate_for_run(config: TrainConfig, world_size: int, engine_kind: str, *,
                     fsdp_settings: FsdpSettings | None = None,
                     deepspeed_raw: dict | None = None, local_world_size: int | None = None,
                     on_gpu: bool = False) -> int | None:
    """Estimated tensors of a step per rank (model states, buffers, activations) for the run as launched.
    ``engine_kind`` is EnginePlan.kind; None when the model shape is unknown. What a run measures also holds
    the set-up and, on the CPU, the runtime: compare with ``estimate_run_memory`` instead."""
    found = estimate_run_memory(config, world_size, engine_kind, fsdp_settings=fsdp_settings,
                                deepspeed_raw=deepspeed_raw, local_world_size=local_world_size, on_gpu=on_gpu)
    return None if found is None else int(round(found.training))


def estimate_run_memory(config: TrainConfig, world_size: int, engine_kind: str, *,
                        fsdp_settings: FsdpSettings | None = None, deepspeed_raw: dict | None = None,
                        local_world_size: int | None = None, on_gpu: bool = False) -> RunMemoryEstimate | None:
    """The estimate of what a run measures per rank (see compare.py); None when the model shape is unknown."""
    try:
        device, setup = _run_states(config, world_size, engine_kind, fsdp_settings, deepspeed_raw,
                                    local_world_size or world_size, on_gpu)
    except ShardtuneError:
        return None  # the shape is unknown here (or not LLaMA-like): nothing to record
    return run_memory_estimate(device, setup, on_gpu, engine_kind, workload_from_config(config).mixed_precision)


def _run_states(config: TrainConfig, world_size: int, engine_kind: str, fsdp_settings: FsdpSettings | None,
                deepspeed_raw: dict | None, nproc: int, on_gpu: bool) -> tuple[Components, Setup]:
    shape = model_shape_for(config)
    hardware = hardware_for(world_size, nproc, 1 if on_gpu else None, 0)
    c = Context(shape, workload_from_config(config), hardware)
    device, _, setup = _engine_states(EnginePlan(engine_kind, fsdp_settings, deepspeed_raw), c)[1](c)
    return device, setup
