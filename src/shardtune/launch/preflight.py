"""What `shardtune train` and `shardtune check` decide on the launching host before any process starts.

One round: the launch variables, every key's type, the rules between keys, the files, the engine and the data are
checked together, and every problem is raised at once. The result is a ``RunPlan`` (the resolved config, the engine
plan, the world layout), written into the run folder for the ranks, which trust it (launch/worker.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardtune import run_files
from shardtune.config.args import CommandLine, read_config
from shardtune.config.generation import prediction_datasets, predicts_only
from shardtune.config.load import KeyProblem, build_config, config_to_dict
from shardtune.config.schema import TrainConfig
from shardtune.engines.engine_plan import EnginePlan
from shardtune.engines.expert_parallel_plan import expert_parallel_problems
from shardtune.engines.plan import plan_engine
from shardtune.engines.sequence_parallel_plan import sequence_parallel_problems, with_deepspeed_sequence_parallel
from shardtune.errors import ConfigError, ShardtuneError
from shardtune.host import cuda_visible_devices, local_cpu_memory, local_gpu_memory, visible_gpu_count
from shardtune.launch import env as launch_env
from shardtune.launch.kernels_here import local_kernel_problems
from shardtune.launch.model_checks import attention_problems
from shardtune.launch.nodes import master_problem
from shardtune.launch.optimizer_checks import badam_launch_problems
from shardtune.launch.resume_check import resume_read_problems
from shardtune.launch.run_lock import live_run_problems, stale_lock_warning
from shardtune.launch.torchrun import LaunchPlan, device_problems, plan_launch
from shardtune.launch.validate import cross_key_problems, file_problems
from shardtune.paths import home_expanded, reads_as_hub_id
from shardtune.train.checkpoint_folders import checkpoint_problems, resume_source
from shardtune.world import WorldLayout

PLAN_MARK = "shardtune_run_plan"  # the top-level key that tells a rank the file is a resolved plan


@dataclass(frozen=True)
class RunPlan:
    """Everything a run was decided to be: the rank entry reads it, the dry run prints it."""

    config: TrainConfig
    engine: EnginePlan
    layout: WorldLayout
    switches: frozenset[str] = frozenset()
    launch: LaunchPlan | None = None  # how torchrun starts the ranks (the launching host only)
    scheduler: str | None = None  # SLURM, PyTorchJob, TrainJob: whose variables decided the nodes

    @property
    def run_dir(self) -> Path:
        return Path(self.config.output_dir or ".")


def plan_run(argv: list[str], ranks_here: bool = False) -> RunPlan:
    """The launching host's plan: launch variables and config checked together (one round of problems).
    ``ranks_here``: this command starts the ranks on this host (train), so the kernels they need are checked here
    too (``check`` passes a config whose ranks may run on another machine).

    With a bad launch variable the world size is unknown: only the checks that do not depend on it run.
    """
    try:
        env = launch_env.read_launch_env()
    except ConfigError as launch_error:
        config, _, key_problems, later = read_checked_config(argv)
        later += sequence_parallel_problems(config) + expert_parallel_problems(config)
        if launch_env.ray_requested():
            from shardtune.launch.ray_plan import ray_init_function, ray_problems

            later += ray_problems(config, ray_init_function())
        raise ConfigError(*launch_error.problems, *problem_lines(key_problems, later)) from None
    launch = plan_launch(env, visible_gpu_count())
    return preflight(argv, launch.nnodes, launch.nproc_per_node, launch=launch, scheduler=env.scheduler,
                     ranks_here=ranks_here)


def preflight(argv: list[str], nodes: int, procs_per_node: int, *, defaults: dict[str, Any] | None = None,
              announce: bool = True, launch: LaunchPlan | None = None, scheduler: str | None = None,
              ranks_here: bool = False) -> RunPlan:
    """Load and check everything that can be checked without weights for ``nodes`` x ``procs_per_node`` ranks;
    raise every problem at once. ``announce``: say the attention kernel a config chose (ranks do not repeat it)."""
    config, cmd, key_problems, later = read_checked_config(argv, defaults)
    later += run_lock_problems(config, announce)
    if launch is not None and launch.use_ray:  # Ray places the workers: the world is ray_num_workers ranks
        from shardtune.launch.ray_plan import ray_init_function, ray_problems

        nodes, procs_per_node = 1, config.ray_num_workers
        later += ray_problems(config, ray_init_function())
    elif launch is not None and config.ray_num_workers > 1:
        print(f"shardtune: warning: ray_num_workers ({config.ray_num_workers}) is read only with USE_RAY=1; "
              "launching without Ray", file=sys.stderr)
    if launch is not None:
        later += device_problems(launch, visible_gpu_count(), cuda_visible_devices(), scheduler)
        if ranks_here and launch.nnodes == 1 and not launch.use_ray:  # (several nodes: the node check says it)
            later += [p for p in [master_problem(launch, scheduler)] if p]
        later += badam_launch_problems(config, launch.force_torchrun)
    later += worker_process_problems(config, procs_per_node, launch_env.node_cpus())
    if ranks_here and not key_problems:  # before the attention choice below reads the model's config.json
        later += hub_model_problems(config)
    layout = WorldLayout(nodes, procs_per_node, config.per_device_train_batch_size,
                         config.gradient_accumulation_steps, sequence_parallel=config.sequence_parallel_size,
                         expert_parallel=config.expert_parallel_size)
    has_cuda = visible_gpu_count() > 0
    attention_was_auto = config.attn_implementation == "auto"
    try:  # the steps below read the model's config.json: a damaged one is already among the file problems
        config = apply_attention_auto(config, has_cuda=has_cuda, announce_choice=announce)
        if config.engine == "auto" and not key_problems and not later:  # the estimate needs a sound config
            config, auto_problems = apply_engine_auto(config, layout)
            later += auto_problems
            layout = replace(layout, sequence_parallel=config.sequence_parallel_size)
        engine, engine_problems = plan_engine(config, layout.world_size, has_cuda=has_cuda)
        later += engine_problems + data_problems(config) + layout_problems(config, engine, layout)
        if config.stage == "grpo" and not key_problems and not later:  # the prompts read well: are they short enough
            later += rl_prompt_problems(config)
        later += resume_problems(config, engine)
        if attention_was_auto:  # a chosen kernel was checked with the other keys; one picked here is checked now
            later += attention_problems(config)
    except ShardtuneError as err:
        later += [p for p in err.problems if p not in later]
        engine = EnginePlan("local")
    if ranks_here and launch is not None and not launch.use_ray:
        later += unsaid(local_kernel_problems(config, visible_gpu_count()), later)
    later += sequence_parallel_problems(config, layout)  # after the attention kernel is decided
    later += expert_parallel_problems(config, engine, layout)
    problems = problem_lines(key_problems, later)
    if problems:
        raise ConfigError(*problems)
    return RunPlan(config, engine, layout, frozenset(cmd.switches), launch, scheduler)


# Helper processes (data loaders, tokenisers) a node may start: LLaMA-Factory's files ask 16 tokenisers, fine on a
# laptop; past this (a number meant for a far larger machine, or a typo) the forks take the node's memory.
WORKERS_PER_CPU, WORKERS_ANYWHERE = 8, 64


def hub_model_problems(config: TrainConfig) -> list[str]:
    """A hub id as model_name_or_path is downloaded here, on each node's launching host, before any rank starts:
    the ranks then read the cache. Offline (HF_HUB_OFFLINE) the cache is used as it is (validate says when the id
    is not there)."""
    from huggingface_hub import constants

    from shardtune.hub import HubError, fetch_hub_repo

    name = config.model_name_or_path
    if (not name or config.build_tiny_model_if_missing or not reads_as_hub_id(name) or home_expanded(name).exists()
            or constants.HF_HUB_OFFLINE):
        return []
    try:
        fetch_hub_repo(name, what="model_name_or_path", refresh=True, ignore_patterns=MODEL_FILES_NOT_READ)
    except HubError as err:
        return [str(err)]
    return []


# Files of model repositories that transformers does not read: other frameworks' weights, original checkpoints.
MODEL_FILES_NOT_READ = ["original/*", "*.pth", "*.pt", "*.onnx", "*.msgpack", "*.h5", "*.gguf", "*.ot", "*.tflite"]


def worker_process_problems(config: TrainConfig, procs_per_node: int, cpus: int) -> list[str]:
    """Loader and tokeniser processes this node would start, against its CPUs: each is a copy of a rank's
    process, so a number meant for another machine (or a typo) forks the node out of memory."""
    limit = max(WORKERS_ANYWHERE, WORKERS_PER_CPU * cpus)
    problems = []
    loaders = config.dataloader_num_workers * procs_per_node
    if loaders > limit:
        problems.append(f"dataloader_num_workers ({config.dataloader_num_workers}) x {procs_per_node} rank(s) on "
                        f"this node = {loaders} loader processes for {cpus} CPU(s) (at most {limit}): each is a copy "
                        "of its rank, and so many take the node's memory; give at most "
                        f"{max(limit // procs_per_node, 0)}")
    tokenisers = config.preprocessing_num_workers or 0
    if tokenisers > limit:
        problems.append(f"preprocessing_num_workers ({tokenisers}) is more than {limit} processes for {cpus} CPU(s): "
                        f"give at most {limit}, or unset it")
    return problems


def run_lock_problems(config: TrainConfig, announce: bool) -> list[str]:
    """A live run of another job holds output_dir: refused, whatever overwrite_output_dir says. A stale lock is
    said (``announce``) and taken over when the run starts."""
    if not config.output_dir:
        return []
    out = Path(config.output_dir)
    warning = stale_lock_warning(out) if announce else None
    if warning:
        print(f"shardtune: warning: {warning}", file=sys.stderr)
    return live_run_problems(out, launch_env.run_job_id())


def unsaid(problems: list[str], said: list[str]) -> list[str]:
    """``problems`` whose key (the text before its first " (") no line of ``said`` starts with: one line per key."""
    keys = {line.split(" (", 1)[0] for line in said}
    return [p for p in problems if p.split(" (", 1)[0] not in keys]


def read_checked_config(argv: list[str], defaults: dict[str, Any] | None = None
                        ) -> tuple[TrainConfig, CommandLine, list[KeyProblem], list[str]]:
    """The config, its command line, the keys whose values cannot be used, and the problems of the rules between
    keys and on files (those need no world size). A DeepSpeed JSON's ``sequence_parallel_size`` is read into the
    config here, before anything depends on it (the attention kernel, the world layout)."""
    config, cmd, key_problems = read_config(argv, defaults)
    config = continued_when_requeued(config)
    config, sequence_problems = with_deepspeed_sequence_parallel(config)
    return config, cmd, key_problems, sequence_problems + cross_key_problems(config) + file_problems(config)


def continued_when_requeued(config: TrainConfig) -> TrainConfig:
    """A job its scheduler requeued (Slurm's SLURM_RESTART_COUNT, after a preemption or ``scontrol requeue``)
    continues from its newest complete checkpoint: overwrite_output_dir applies to the first attempt only."""
    restarts = launch_env.scheduler_restart_count()
    if restarts == 0 or not config.overwrite_output_dir:
        return config
    print(f"[shardtune] requeued by Slurm (restart {restarts}): resuming from the latest complete checkpoint "
          "instead of overwriting output_dir", file=sys.stderr, flush=True)
    return replace(config, overwrite_output_dir=False)


def problem_lines(key_problems: list[KeyProblem], later: list[str]) -> list[str]:
    """Every problem once: the unusable keys, then the later rules' problems that do not judge one of those keys."""
    return [p.text for p in key_problems] + without_keys(later, {p.key for p in key_problems if p.key})


def without_keys(problems: list[str], keys: set[str]) -> list[str]:
    """Problems that judge none of ``keys``: a key whose value was unusable has its default standing in, and a rule
    about that default would be noise."""
    if not keys:
        return problems
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(keys)) + r")\b")
    return [p for p in problems if not pattern.search(p)]


def apply_engine_auto(config: TrainConfig, layout: WorldLayout) -> tuple[TrainConfig, list[str]]:
    """`engine: auto`: the fastest engine option the memory estimate says fits, decided here, once; when none fits
    whole rows, with each row split over ranks (sequence parallelism, whose split attention runs every kernel)."""
    from shardtune.estimate.config import recommend_for_config

    try:
        values, reason = recommend_for_config(config, layout.world_size, layout.procs_per_node, local_gpu_memory(),
                                              local_cpu_memory())
    except ConfigError as err:
        return config, err.problems
    chosen = ", ".join(f"{k}: {v}" for k, v in values.items()) or "DDP (no deepspeed/fsdp)"
    print(f"[shardtune] engine auto -> {chosen}: {reason}", flush=True)
    return replace(config, engine="manual", **values), []


def apply_attention_auto(config: TrainConfig, has_cuda: bool, announce_choice: bool = True) -> TrainConfig:
    """`attn_implementation: auto` (LLaMA-Factory's flash_attn: auto; the default): a kernel the model's class
    supports, decided here once from its config.json, before any weights load, and said with the reason.
    ``announce_choice``: also say a kernel the config chose (the launching host does; its ranks do not repeat it).
    """
    from shardtune.data.settings import packs_half_rows
    from shardtune.model.attention import AUTO, auto_choice, known_model_config

    name = config.model_name_or_path
    if name is None:
        return config
    if config.attn_implementation != AUTO:
        if announce_choice:
            print(f"[shardtune] attention: {config.attn_implementation} (asked for: attn_implementation / "
                  "flash_attn)", flush=True)
        return config
    known = known_model_config(name, builds_tiny_model=config.build_tiny_model_if_missing)
    if known is None:
        print(f"[shardtune] attention: auto, decided on each rank once it has loaded {name}'s config", flush=True)
        return config
    choice = auto_choice(known, has_cuda=has_cuda, model=name, splits_sequences=config.sequence_parallel_size > 1,
                         packed_half_rows=packs_half_rows(config))
    print(f"[shardtune] attention: {choice.kernel} ({choice.reason})", flush=True)
    return replace(config, attn_implementation=choice.kernel)


def data_problems(config: TrainConfig) -> list[str]:
    from shardtune.data.checks import check_data_settings
    from shardtune.train.settings import data_settings

    return check_data_settings(data_settings(config)) if config.dataset else []


def rl_prompt_problems(config: TrainConfig) -> list[str]:
    """Stage grpo's prompts built as the ranks build them (data/rl_prompts.py, the owner of the rule that a prompt
    must leave max_completion_length tokens of cutoff_len), so that a prompt too long is refused before any rank
    starts. Rank 0 builds them again (0.06 s for the shipped example's; loading the tokenizer is most of this)."""
    from shardtune.data.rl_prompts import build_rl_prompts
    from shardtune.model.load import has_model_files, load_tokenizer
    from shardtune.train.settings import data_settings

    model = home_expanded(config.model_name_or_path or "")
    if not has_model_files(model):  # a hub id, or a folder built at launch: the ranks check its prompts
        return []  # (asking the hub for a tokenizer here could wait on the network)
    try:
        tokenizer = load_tokenizer(str(model), trust_remote_code=config.trust_remote_code)
    except Exception:  # noqa: BLE001 - a folder the model's own loading reports on
        return []
    try:
        build_rl_prompts(tokenizer, data_settings(config), config.max_completion_length)
    except ShardtuneError as err:
        return list(err.problems)
    return []


def layout_problems(config: TrainConfig, engine: EnginePlan, layout: WorldLayout) -> list[str]:
    """What the engine's settings must agree with in this world: hybrid groups, DeepSpeed's batch, a resume."""
    if engine.fsdp is not None and engine.fsdp.is_hybrid:
        try:
            layout.hybrid_groups(engine.fsdp.sharding_strategy, engine.fsdp.hsdp_shard_size)
        except ValueError as err:
            return [f"fsdp: {err}"]
    if engine.kind != "deepspeed" or engine.deepspeed_raw is None:
        return []
    from shardtune.engines.deepspeed_autoep import autoep_resume_problems
    from shardtune.engines.deepspeed_checks import deepspeed_problems
    from shardtune.engines.deepspeed_config import deepspeed_inputs
    from shardtune.engines.deepspeed_config import resume_problems as zero_resume_problems

    source = resume_source(config)
    return deepspeed_problems(engine.deepspeed_raw, deepspeed_inputs(config, layout),
                              engine.deepspeed_source or "deepspeed") + \
        zero_resume_problems(engine.deepspeed_raw, source, layout.world_size) + \
        autoep_resume_problems(source, config.expert_parallel_size, layout.world_size)


def resume_problems(config: TrainConfig, engine: EnginePlan) -> list[str]:
    """The checkpoint to resume from, if it is a sound one, must be readable by this run's engine and shapes."""
    source = resume_source(config)
    if source is None or checkpoint_problems(source):  # a damaged one is among the file problems already
        return []
    key = "resume_from_checkpoint" if config.resume_from_checkpoint else f"output_dir (resuming from {source})"
    return resume_read_problems(config, engine, source, key)


def check_command(argv: list[str]) -> int:
    """`shardtune check`: the whole preflight, the memory verdict, and one line saying what would run."""
    plan = plan_run(argv)
    c = plan.config
    warning = memory_warning(plan)
    if warning:
        print(f"shardtune: warning: {warning}", file=sys.stderr)
    # The config may be meant for another machine's ranks; `train` here would refuse these (kernels_here.py).
    for problem in local_kernel_problems(c, visible_gpu_count()):
        print(f"shardtune: warning: on this machine, train would refuse: {problem}", file=sys.stderr)
    task = (f"predictions of {c.model_name_or_path} for {','.join(prediction_datasets(c))}" if predicts_only(c)
            else f"{c.stage} / {c.finetuning_type} of {c.model_name_or_path} on {','.join(c.dataset)}")
    split = f" ({plan.layout.sequence_parallel} ranks per sequence)" if plan.layout.sequence_parallel > 1 else ""
    print(f"ok: {task}; "
          f"engine {plan.engine.kind}, world size {plan.layout.world_size}{split}, global batch "
          f"{plan.layout.global_batch} -> {c.output_dir}")
    return 0


def memory_warning(plan: RunPlan) -> str | None:
    """The memory estimate's verdict on the engine this plan runs (None when it fits or cannot be estimated)."""
    from shardtune.estimate.config import fit_warning

    return fit_warning(plan.config, plan.layout.world_size, plan.layout.procs_per_node, local_gpu_memory(),
                       local_cpu_memory(), engine=plan.engine)


def write_run_plan(plan: RunPlan) -> Path:
    """The resolved config and engine plan for the ranks; written atomically since every node may write it."""
    path = plan.run_dir / run_files.LAUNCH_PLAN
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({PLAN_MARK: 1, **run_plan_dict(plan)}, indent=2))
    tmp.replace(path)
    return path


def run_plan_dict(plan: RunPlan) -> dict[str, Any]:
    """The resolved config and engine plan as the ranks read them (and the node check compares them)."""
    return {"config": config_to_dict(plan.config), "engine": plan.engine.to_dict()}


def read_run_plan(path: str) -> tuple[TrainConfig, EnginePlan] | None:
    """The plan the launching host wrote at ``path``; None when ``path`` is a user's config file instead."""
    if not path.endswith(".json") or not Path(path).is_file():
        return None
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or PLAN_MARK not in data:
        return None
    return build_config(data["config"], source=path), EnginePlan.from_dict(data["engine"])
