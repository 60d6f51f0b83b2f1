"""DeepSpeed JSON: presets, loading, checks against the training keys, and "auto" resolution.

Pure functions (no process group, no deepspeed import) so every rule is unit-tested without processes and
runs on the launching host before any rank starts. The training keys (batch size, accumulation, clipping,
precision) are the source of truth: the JSON may leave them "auto" or out, but may not contradict them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtune.config.schema import TrainConfig
from shardtune.engines.spec import (
    CheckpointLayout,
    EngineSpec,
    MemoryLayout,
    compile_problems,
    depth_problems,
    float8_problems,
    pissa_problems,
    pre_quantized_problems,
    preference_problems,
    whole_weight_optimizer_problems,
)
from shardtune.errors import ConfigError, ModelError
from shardtune.model.folder import model_config_json
from shardtune.optim.settings import OptimizerSettings, optimizer_settings
from shardtune.paths import home_expanded
from shardtune.world import WorldLayout

if TYPE_CHECKING:
    from shardtune.engines.engine_plan import EnginePlan

PRESET_DIR = Path(__file__).resolve().parent / "presets"
PRESETS: dict[str, str] = {
    "z0": "ds_z0_config.json",
    "z1": "ds_z1_config.json",
    "z2": "ds_z2_config.json",
    "z2_offload": "ds_z2_offload_config.json",
    "z3": "ds_z3_config.json",
    "z3_offload": "ds_z3_offload_config.json",
}
AUTO = "auto"

# Top-level keys DeepSpeed 0.19.8 reads (deepspeed/runtime/config.py and the config classes it builds).
# DeepSpeed itself ignores any other key, so a typo would silently fall back to a default.
DEEPSPEED_TOP_LEVEL_KEYS = frozenset({
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
    "comms_logger", "communication_data_type", "compile", "compression_training", "csv_monitor",
    "data_efficiency", "data_parallel_size", "data_types", "dataloader_drop_last", "datastates_ckpt",
    "disable_allgather", "disable_python_gc", "dump_state", "expert_parallel", "flops_profiler", "fp16",
    "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping", "gradient_predivide_factor",
    "hybrid_engine", "log_level", "managed_gradient_accumulation", "memory_breakdown", "nebula", "optimizer",
    "pipeline", "prescale_gradients", "quantize_training", "scheduler", "seq_parallel_communication_data_type",
    "sequence_parallel_size", "sparse_gradients", "steps_per_print", "tensor_parallel", "tensorboard", "timers",
    "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu", "use_data_before_expert_parallelism",
    "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "zero_optimization",
})
# Blocks DeepSpeed 0.19.8 removed: it refuses them at initialize, we say so before launching.
REMOVED_TOP_LEVEL_KEYS = frozenset({"eigenvalue", "sparse_attention", "elasticity", "graph_harvesting",
                                    "curriculum_learning", "progressive_layer_drop"})
# LLaMA-Factory's recent example files carry these; DeepSpeed never reads them (its keys are comms_logger and
# tensorboard/wandb/csv_monitor), so they are accepted for compatibility and dropped from the resolved config.
IGNORED_FOREIGN_KEYS = frozenset({"comms_config", "monitor_config"})
# DeepSpeed's own Ulysses size: shardtune splits sequences itself (sequence_parallel_size), so the value becomes
# that key (engines/sequence_parallel_plan.py) and DeepSpeed, which would shrink its data-parallel size, never sees it.
SEQUENCE_PARALLEL_KEY = "sequence_parallel_size"

# Optimizer types DeepSpeed can run on the CPU when the optimizer is offloaded.
CPU_OFFLOAD_OPTIMIZER_TYPES = frozenset({"adam", "adamw", "adagrad", "lion"})
# Our optimizers DeepSpeed's ZeRO treats as tested (torch Adam/AdamW); others need zero_allow_untested_optimizer.
ADAM_OPTIMS = frozenset({"adamw_torch", "adamw_torch_fused"})

# DeepSpeed's own defaults, used for the hidden-size-based "auto" values when the hidden size is unknown.
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000
DEFAULT_PREFETCH_BUCKET_SIZE = 50_000_000
DEFAULT_PARAM_PERSISTENCE_THRESHOLD = 100_000
GATHER_ON_SAVE_KEYS = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                       "stage3_gather_fp16_weights_on_model_save")


@dataclass(frozen=True)
class DeepSpeedInputs:
    """The training settings a DeepSpeed config must agree with (HF Trainer names in the comments)."""

    layout: WorldLayout  # micro batch, accumulation and data-parallel ranks: train_batch_size
    max_grad_norm: float
    bf16: bool
    fp16: bool
    hidden_size: int | None  # model config hidden_size, for the ZeRO bucket sizes
    optimizer: OptimizerSettings = OptimizerSettings()  # fills a JSON optimizer section's "auto" values
    total_steps: int | None = None  # for a JSON scheduler's total_num_steps "auto"
    warmup_steps: int = 0

    @property
    def train_batch_size(self) -> int:
        # DeepSpeed counts every rank as data parallel: shardtune splits sequences itself (engines/sequence_parallel)
        # and DeepSpeed never hears of it, so with sequence_parallel_size N its number is N x the samples per step.
        return self.layout.micro_batch * self.layout.grad_accum * self.layout.world_size


def deepspeed_inputs(config: TrainConfig, layout: WorldLayout) -> DeepSpeedInputs:
    """What the config and the world layout say about the settings a DeepSpeed config must agree with."""
    hidden = (model_config_json(config.model_name_or_path) or {}).get("hidden_size")
    return DeepSpeedInputs(
        layout=layout,
        max_grad_norm=config.max_grad_norm,
        bf16=config.bf16,
        fp16=config.fp16,
        hidden_size=int(hidden) if hidden else None,
        optimizer=optimizer_settings(config),
        warmup_steps=config.warmup_steps,
    )


# --- loading ---

def load_deepspeed_setting(value: str | dict) -> tuple[dict, str]:
    """The raw config and a description of where it came from: preset name, JSON file path or inline mapping."""
    if isinstance(value, dict):
        return copy.deepcopy(value), "the inline deepspeed mapping"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"deepspeed ({value!r}): expected a preset name ({preset_list()}), "
                          "a JSON file path or a mapping")
    if value in PRESETS:
        return read_json_config(PRESET_DIR / PRESETS[value]), f"preset {value} ({PRESETS[value]})"
    path = home_expanded(value)
    if path.is_dir():
        raise ConfigError(f"deepspeed: {value} is a folder; give its JSON file or a preset ({preset_list()})")
    if not path.is_file():
        raise ConfigError(f"deepspeed ({value}): no such preset or file; presets are: {preset_list()}")
    return read_json_config(path), str(path)


def preset_list() -> str:
    return ", ".join(PRESETS)


def read_json_config(path: Path) -> dict:
    """Parse a JSON object; syntax errors and duplicate keys name the file, line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"deepspeed: cannot read {path} as a JSON text file ({err}); give a DeepSpeed JSON "
                          f"file or a preset ({preset_list()})") from None
    try:
        data = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as err:
        raise ConfigError(f"deepspeed: {path} is not valid JSON: {err.msg} at line {err.lineno}, "
                          f"column {err.colno}") from None
    except _DuplicateKey as dup:
        raise ConfigError(f"deepspeed: {path} has the key '{dup.key}' twice in one object") from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed: {path} must hold a JSON object, not {type(data).__name__}")
    return data


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    # DeepSpeed refuses duplicate keys too (dict_raise_error_on_duplicate_keys); json would keep the last.
    result: dict = {}
    for key, val in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = val
    return result


def show_json(value: Any) -> str:
    """A value as the JSON file spells it, for messages."""
    return json.dumps(value)


def sequence_parallel_in(raw: dict, source: str, configured: int) -> tuple[int, list[str]]:
    """The sequence-parallel size to run with, given the JSON's ``sequence_parallel_size`` and the top-level key's
    ``configured`` value (1, its default, defers to the JSON; "auto" in the JSON defers to the key); and the
    problems: a value that is no size, or two sizes that disagree."""
    value = raw.get(SEQUENCE_PARALLEL_KEY)
    if value is None or value == AUTO:
        return configured, []
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return configured, [f"{SEQUENCE_PARALLEL_KEY} in {source}: must be a whole number of at least 1, got "
                            f"{show_json(value)}"]
    if configured not in (1, value):
        return configured, [f"{SEQUENCE_PARALLEL_KEY} ({value}) in {source} contradicts sequence_parallel_size "
                            f"({configured}); keep one (shardtune splits the sequences either way)"]
    return value, []


# --- queries on a (raw or resolved) config ---

def zero_section(cfg: dict) -> dict:
    section = cfg.get("zero_optimization")
    return section if isinstance(section, dict) else {}


def zero_stage(cfg: dict) -> int:
    stage = zero_section(cfg).get("stage", 0)
    return int(stage) if isinstance(stage, int | float) and not isinstance(stage, bool) else -1


def _offloads(cfg: dict, key: str) -> bool:
    section = zero_section(cfg).get(key)
    return isinstance(section, dict) and str(section.get("device", "none")).lower() not in ("none", "")


def offloads_optimizer(cfg: dict) -> bool:
    return _offloads(cfg, "offload_optimizer")


def offloads_params(cfg: dict) -> bool:
    return _offloads(cfg, "offload_param")


def gathers_weights_on_save(cfg: dict) -> bool:
    """True: the final ZeRO-3 save builds one consolidated state dict; otherwise it is written module by module
    (``engines/deepspeed_save.py``). DeepSpeed's default is off."""
    zero = zero_section(cfg)
    return any(zero.get(key) is True for key in GATHER_ON_SAVE_KEYS)


def has_own_optimizer(cfg: dict) -> bool:
    return isinstance(cfg.get("optimizer"), dict)


def has_own_scheduler(cfg: dict) -> bool:
    return isinstance(cfg.get("scheduler"), dict)


def precision_section(cfg: dict, name: str) -> dict:
    # DeepSpeed still reads the old "bfloat16" spelling when "bf16" is absent.
    section = cfg.get(name)
    if section is None and name == "bf16":
        section = cfg.get("bfloat16")
    return section if isinstance(section, dict) else {}


# --- "auto" resolution ---

def auto_values(inputs: DeepSpeedInputs) -> dict[tuple[str, ...], Callable[[], Any]]:
    """The value each resolvable "auto" takes (HF Trainer's rules), keyed by its path in the config."""
    hidden = inputs.hidden_size
    return {
        ("train_batch_size",): lambda: inputs.train_batch_size,
        ("train_micro_batch_size_per_gpu",): lambda: inputs.layout.micro_batch,
        ("gradient_accumulation_steps",): lambda: inputs.layout.grad_accum,
        ("gradient_clipping",): lambda: inputs.max_grad_norm,
        ("fp16", "enabled"): lambda: inputs.fp16,
        ("bf16", "enabled"): lambda: inputs.bf16,
        ("bfloat16", "enabled"): lambda: inputs.bf16,
        ("zero_optimization", "reduce_bucket_size"): lambda: auto_zero_sizes(hidden)["reduce_bucket_size"],
        ("zero_optimization", "stage3_prefetch_bucket_size"):
            lambda: auto_zero_sizes(hidden)["stage3_prefetch_bucket_size"],
        ("zero_optimization", "stage3_param_persistence_threshold"):
            lambda: auto_zero_sizes(hidden)["stage3_param_persistence_threshold"],
        ("optimizer", "params", "lr"): lambda: inputs.optimizer.learning_rate,
        ("optimizer", "params", "betas"): lambda: [inputs.optimizer.adam_beta1, inputs.optimizer.adam_beta2],
        ("optimizer", "params", "eps"): lambda: inputs.optimizer.adam_epsilon,
        ("optimizer", "params", "weight_decay"): lambda: inputs.optimizer.weight_decay,
        ("scheduler", "params", "warmup_min_lr"): lambda: 0.0,
        ("scheduler", "params", "warmup_max_lr"): lambda: inputs.optimizer.learning_rate,
        ("scheduler", "params", "warmup_num_steps"): lambda: inputs.warmup_steps,
        ("scheduler", "params", "total_num_steps"): lambda: inputs.total_steps,
    }


def auto_zero_sizes(hidden: int | None) -> dict[str, int]:
    """ZeRO's "auto" sizes in elements: the HF Trainer's hidden-size rules with floors, so that a small model is not
    latency-bound.

    The Trainer's rules (``hidden^2`` buckets, ``10 x hidden`` persistence) give a 0.5B model (hidden 896) buckets
    smaller than one MLP weight, one collective per few tensors, and partition every LoRA adapter and norm. Here
    the buckets are at least DeepSpeed's own defaults (5e8 to reduce, 5e7 to prefetch), and tensors below a quarter
    of one hidden x hidden matrix, up to DeepSpeed's 1e5 default, stay whole on every rank (adapters of rank below
    hidden / 4, norms, biases): they cost a few MiB and would each need a gather per use.
    """
    if not hidden:
        return {"reduce_bucket_size": DEFAULT_REDUCE_BUCKET_SIZE,
                "stage3_prefetch_bucket_size": DEFAULT_PREFETCH_BUCKET_SIZE,
                "stage3_param_persistence_threshold": DEFAULT_PARAM_PERSISTENCE_THRESHOLD}
    return {"reduce_bucket_size": max(hidden * hidden, DEFAULT_REDUCE_BUCKET_SIZE),
            "stage3_prefetch_bucket_size": max(int(0.9 * hidden * hidden), DEFAULT_PREFETCH_BUCKET_SIZE),
            "stage3_param_persistence_threshold": max(10 * hidden,
                                                      min(DEFAULT_PARAM_PERSISTENCE_THRESHOLD, hidden * hidden // 4))}


# Keys whose "auto" is DeepSpeed's own default value: resolved by leaving the key out.
DEEPSPEED_NATIVE_AUTO = frozenset({("data_types", "keep_in_fp32_modules")})
# Keys the training settings decide; filled from them when the JSON leaves them out.
FILLED_WHEN_MISSING = (("train_batch_size",), ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",),
                       ("gradient_clipping",), ("fp16", "enabled"), ("bf16", "enabled"))


def walk_auto(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Paths of every "auto" value, nested mappings and lists included."""
    if isinstance(node, dict):
        for key, val in node.items():
            yield from walk_auto(val, (*path, str(key)))
    elif isinstance(node, list):
        for i, val in enumerate(node):
            yield from walk_auto(val, (*path, str(i)))
    elif node == AUTO:
        yield path


def _set_path(cfg: dict, path: tuple[str, ...], value: Any) -> None:
    node = cfg
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def get_path(cfg: dict, path: tuple[str, ...]) -> Any:
    node: Any = cfg
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def resolve_deepspeed_config(raw: dict, inputs: DeepSpeedInputs) -> dict:
    """The config DeepSpeed will see: every "auto" replaced, training keys filled in; deterministic and JSON-able.

    Call after ``deepspeed_checks.deepspeed_problems`` came back empty; an "auto" left over is an internal error.
    """
    cfg = json.loads(json.dumps(raw))  # deep copy that also proves the mapping is plain JSON
    for key in (*IGNORED_FOREIGN_KEYS, SEQUENCE_PARALLEL_KEY):
        cfg.pop(key, None)
    if "bfloat16" in cfg and "bf16" not in cfg:
        cfg["bf16"] = cfg.pop("bfloat16")
    values = auto_values(inputs)
    for path in list(walk_auto(cfg)):
        if path in DEEPSPEED_NATIVE_AUTO:
            get_path(cfg, path[:-1]).pop(path[-1])
        elif path in values:
            _set_path(cfg, path, values[path]())
    for path in FILLED_WHEN_MISSING:
        if get_path(cfg, path) is None:
            _set_path(cfg, path, values[path]())
    leftover = [".".join(p) for p in walk_auto(cfg)]
    assert not leftover, f"unresolved 'auto' in DeepSpeed config: {leftover}"
    return cfg


def zero_shard_writers(tag_dir: Path) -> int:
    """How many data-parallel ranks wrote the ZeRO optimizer shards in ``tag_dir`` (0: not sharded)."""
    return len(list(Path(tag_dir).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")))


def resume_problems(raw: dict, checkpoint_dir: Path | None, world_size: int) -> list[str]:
    """ZeRO shards are tied to the world size that wrote them; shardtune re-splits them on load (ZeRO-3 through
    DeepSpeed's universal checkpoint, ZeRO-1/2 itself), except optimizer state kept on NVMe."""
    if checkpoint_dir is None:
        return []
    writers = zero_shard_writers(Path(checkpoint_dir) / "deepspeed")
    offload = raw.get("zero_optimization", {}).get("offload_optimizer") or {}
    if writers and writers != world_size and offload.get("device") == "nvme":
        return [f"checkpoint {checkpoint_dir} holds ZeRO shards of {writers} processes with the optimizer state "
                f"on NVMe, and this run has {world_size}: resume with {writers} processes, or run `shardtune "
                f"export {checkpoint_dir} --out DIR` and start a new run from DIR"]
    return []


# --- the engine's record (engines/spec.py) ---

CHECKPOINT_TAG = "deepspeed"  # fixed tag: one DeepSpeed state per shardtune checkpoint-<step> folder


def read_zero_checkpoint(model: Any, folder: Path) -> dict[str, Any]:
    """The fp32 weights of a ZeRO checkpoint gathered in this one process, whatever number of ranks wrote it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from shardtune.engines.safe_load import weights_only_loads

    if any((Path(folder) / CHECKPOINT_TAG).glob("layer_*_expert_*_model_states.pt")):
        raise ModelError(f"export: {folder} was written with DeepSpeed's AutoEP (expert_parallel_size > 1): its ZeRO "
                         "shards hold each rank's experts under AutoEP's names; export the run's output_dir (saved "
                         "under transformers' names), or resume the run to its end")

    with weights_only_loads():
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=CHECKPOINT_TAG))


def deepspeed_refusals(c: TrainConfig, plan: EnginePlan, has_cuda: bool) -> list[str]:
    """What shardtune does not run under DeepSpeed, each with the reason and what to use instead."""
    stage = zero_stage(plan.deepspeed_raw or {})
    problems = []
    if c.pure_bf16:
        problems.append("pure_bf16 (true) with deepspeed: shardtune does not yet drive DeepSpeed's bf16 master "
                        "weights (bf16_master_weights_and_grads); use bf16: true, or pure_bf16 with DDP")
    if c.fp16 and not has_cuda:
        problems.append("fp16 (true) with deepspeed needs a GPU: DeepSpeed's CPU accelerator has no fp16; "
                        "use bf16: true")
    problems += pre_quantized_problems(c, "deepspeed")
    if stage == 3 and c.quantization_bit is not None:
        problems.append(f"quantization_bit ({c.quantization_bit}) with DeepSpeed ZeRO-3: bitsandbytes weights "
                        "cannot be partitioned; use FSDP (fsdp: full_shard auto_wrap) for sharded QLoRA, or ZeRO-2")
    if stage == 3:
        problems += pissa_problems(c, "DeepSpeed ZeRO-3") + depth_problems(c, "DeepSpeed ZeRO-3")
    if stage == 3 and c.use_dora:
        # peft reads each base weight outside its layer's forward (the norm of W + BA), where ZeRO-3 has released it.
        problems.append("use_dora (true) with DeepSpeed ZeRO-3: DoRA needs each layer's whole base weight outside "
                        "that layer's forward, where ZeRO-3 holds only a partition; use fsdp (full_shard auto_wrap, "
                        "fsdp_version 2) to shard a DoRA run, or ZeRO-2")
    zero3_compile = ("ZeRO-3 gathers and releases every submodule's parameters from hooks inside each decoder "
                     "layer, which would break a compiled layer's graph at every module; use ZeRO-2 or FSDP2 (fsdp: "
                     "full_shard auto_wrap) to shard a compiled run") if stage == 3 else None
    return problems + whole_weight_optimizer_problems(c, "deepspeed") + \
        preference_problems(c, f"DeepSpeed ZeRO-{stage}", shards_weights=stage == 3) + \
        compile_problems(c, f"DeepSpeed ZeRO-{max(stage, 0)}", zero3_compile) + \
        float8_problems(c, f"DeepSpeed ZeRO-{max(stage, 0)}")


def deepspeed_memory_layout(plan: EnginePlan) -> MemoryLayout:
    raw = plan.deepspeed_raw or {}
    stage = max(zero_stage(raw), 0)
    offload = stage >= 2 and (offloads_optimizer(raw) or offloads_params(raw))
    name = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[stage] + ("+offload" if offload else "")
    return MemoryLayout(name, "deepspeed")


def _resolved_settings(plan: EnginePlan, config: TrainConfig, layout: WorldLayout) -> dict | None:
    if plan.deepspeed_raw is None:
        return None
    return resolve_deepspeed_config(plan.deepspeed_raw, deepspeed_inputs(config, layout))


DEEPSPEED = EngineSpec(
    kind="deepspeed",
    describe=lambda plan: f"deepspeed ({plan.deepspeed_source})",
    resolved_settings=_resolved_settings,
    refusals=deepspeed_refusals,
    memory_layout=deepspeed_memory_layout,
    # ZeRO-3; a config whose stage is not a number counts as one
    gathers_parameters=lambda plan: zero_stage(plan.deepspeed_raw or {}) not in (0, 1, 2),
    engine="shardtune.engines.deepspeed_ep:DeepSpeedEngineEP",  # AutoEP when expert_parallel_size > 1
    checkpoints=(CheckpointLayout("deepspeed", CHECKPOINT_TAG, read_zero_checkpoint),),
)
