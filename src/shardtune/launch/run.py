"""What `shardtune train` / `shardtune check` do on the launching host, and what each rank runs.

Flow: load + validate everything here (config, data, engine, launch arithmetic) -> write the resolved config
into the run directory -> run in this process, or start torchrun with the config path -> every rank reads
it, joins the process group, builds its engine and trains.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

from shardtune.config.args import load_config
from shardtune.config.load import config_to_dict
from shardtune.config.schema import TrainConfig
from shardtune.config.validate import attention_problems, validate_config
from shardtune.engines.plan import EnginePlan, plan_engine
from shardtune.errors import ConfigError, ShardtuneError, debug_requested, report_error
from shardtune.launch import env as launch_env
from shardtune.launch.failures import (
    peer_failed_since,
    report_rank_failure,
    save_rank_failure,
    saved_failure_report,
)
from shardtune.launch.launcher_output import LauncherOutput, pump
from shardtune.launch.torchrun import LaunchPlan, build_torchrun_argv, plan_launch, worker_argv

LAUNCH_CONFIG = ".shardtune/launch_config.json"


@dataclass(frozen=True)
class Preflight:
    config: TrainConfig
    switches: frozenset[str]
    engine: EnginePlan
    world_size: int


def preflight(argv: list[str], world_size: int, local_world_size: int | None = None,
              extra_values: dict | None = None) -> Preflight:
    """Load and validate everything that can be checked without weights; raise all problems at once."""
    config, cmd = load_config(argv, defaults=extra_values)
    validate_config(config)
    attention_was_auto = config.attn_implementation == "auto"
    config = apply_attention_auto(config, has_cuda=visible_gpu_count() > 0,
                                  announce_choice=not launch_env.inside_launcher())
    if config.engine == "auto":
        config = apply_engine_auto(config, world_size, local_world_size or world_size)
    engine, problems = plan_engine(config, world_size, has_cuda=visible_gpu_count() > 0)
    problems += _data_problems(config) + _engine_problems(config, engine, world_size, local_world_size or world_size)
    if attention_was_auto:  # a chosen kernel was checked with the other keys; one picked here is checked now
        problems += attention_problems(config)
    if problems:
        raise ConfigError(*problems)
    return Preflight(config, frozenset(cmd.switches), engine, world_size)


def apply_engine_auto(config: TrainConfig, world_size: int, nproc_per_node: int) -> TrainConfig:
    """`engine: auto`: the fastest engine option the memory estimate says fits, decided here, once."""
    from shardtune.estimate.command import local_cpu_memory, local_gpu_memory
    from shardtune.estimate.config import recommend_for_config

    gpu_memory = local_gpu_memory() if visible_gpu_count() else None
    values, reason = recommend_for_config(config, world_size, nproc_per_node, gpu_memory, local_cpu_memory())
    chosen = ", ".join(f"{k}: {v}" for k, v in values.items()) or "DDP (no deepspeed/fsdp)"
    print(f"[shardtune] engine auto -> {chosen}: {reason}", flush=True)
    return replace(config, engine="manual", **values)


def apply_attention_auto(config: TrainConfig, has_cuda: bool, announce_choice: bool = True) -> TrainConfig:
    """`attn_implementation: auto` (LLaMA-Factory's flash_attn: auto; the default): a kernel the model's class
    supports, decided here once from its config.json, before any weights load, and said with the reason.
    ``announce_choice``: also say a kernel the config chose (the launching host does; its ranks do not repeat it).
    """
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
    choice = auto_choice(known, has_cuda=has_cuda, model=name)
    print(f"[shardtune] attention: {choice.kernel} ({choice.reason})", flush=True)
    return replace(config, attn_implementation=choice.kernel)


def _data_problems(config: TrainConfig) -> list[str]:
    from shardtune.data.checks import check_data_settings
    from shardtune.train.settings import data_settings

    return check_data_settings(data_settings(config)) if config.dataset else []


def _engine_problems(config: TrainConfig, engine: EnginePlan, world_size: int, local_world_size: int) -> list[str]:
    if engine.fsdp is not None and engine.fsdp.is_hybrid:
        from shardtune.engines.fsdp_config import hybrid_mesh_shape

        try:
            hybrid_mesh_shape(engine.fsdp, world_size, local_world_size)
        except ValueError as err:
            return [f"fsdp: {err}"]
    if engine.kind != "deepspeed" or engine.deepspeed_raw is None:
        return []
    from shardtune.engines.deepspeed_config import deepspeed_problems, resume_problems
    from shardtune.train.checkpoint import resume_source

    return deepspeed_problems(engine.deepspeed_raw, deepspeed_inputs(config, world_size),
                              engine.deepspeed_source or "deepspeed") + \
        resume_problems(engine.deepspeed_raw, resume_source(config), world_size)



def deepspeed_inputs(config: TrainConfig, world_size: int):
    from shardtune.engines.deepspeed_config import DeepSpeedInputs
    from shardtune.train.settings import optimizer_settings

    return DeepSpeedInputs(
        micro_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        dp_world_size=world_size,
        max_grad_norm=config.max_grad_norm,
        bf16=config.bf16,
        fp16=config.fp16,
        hidden_size=model_hidden_size(config.model_name_or_path),
        optimizer=optimizer_settings(config),
        warmup_steps=config.warmup_steps,
    )


def model_hidden_size(model: str | None) -> int | None:
    """hidden_size from config.json without loading transformers (None for hub ids or missing files)."""
    from shardtune.model.folder import read_config_json

    value = (read_config_json(model or "") or {}).get("hidden_size")
    return int(value) if value else None


def visible_gpu_count() -> int:
    """CUDA devices this process may use, found without importing torch (keeps `check` fast)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def plan_and_preflight(argv: list[str], free_port: int | None = None
                       ) -> tuple[launch_env.LaunchEnv, LaunchPlan, Preflight]:
    """Launch variables and config checked together, so one run of the command shows every problem.

    With a bad launch variable the world size is unknown: only the checks that do not depend on it run.
    """
    try:
        env = launch_env.read_launch_env()
    except ConfigError as launch_error:
        try:
            validate_config(load_config(argv)[0])
        except ShardtuneError as config_error:
            raise ConfigError(*launch_error.problems, *config_error.problems) from None
        raise
    plan = plan_launch(env, visible_gpu_count(), free_port)
    return env, plan, preflight(argv, plan.world_size, plan.nproc_per_node)


def check_command(argv: list[str]) -> int:
    _, plan, pre = plan_and_preflight(argv, free_port=0)
    c = pre.config
    warning = memory_warning(c, plan)
    if warning:
        print(f"shardtune: warning: {warning}", file=sys.stderr)
    print(f"ok: {c.stage} / {c.finetuning_type} of {c.model_name_or_path} on {','.join(c.dataset)}; "
          f"engine {pre.engine.kind}, world size {plan.world_size}, global batch "
          f"{global_batch(c, plan.world_size)} -> {c.output_dir}")
    return 0


def memory_warning(c: TrainConfig, plan: LaunchPlan) -> str | None:
    """The memory estimate's verdict on this launch (None when it fits or cannot be estimated)."""
    from shardtune.estimate.command import local_cpu_memory, local_gpu_memory
    from shardtune.estimate.config import fit_warning

    gpu_memory = local_gpu_memory() if visible_gpu_count() else None
    return fit_warning(c, plan.world_size, plan.nproc_per_node, gpu_memory, local_cpu_memory())


def global_batch(c: TrainConfig, dp_size: int) -> int:
    return c.per_device_train_batch_size * c.gradient_accumulation_steps * dp_size


def train_command(argv: list[str]) -> int:
    if launch_env.inside_launcher():
        return worker_command(argv)
    env, plan, pre = plan_and_preflight(argv)
    use_torchrun = env.force_torchrun or plan.world_size > 1 or pre.engine.needs_process_group
    config_path = Path(pre.config.output_dir or ".") / LAUNCH_CONFIG
    debug = debug_requested(argv)
    commands = [build_torchrun_argv(plan, r, worker_argv(str(config_path), debug), sys.executable)
                for r in range(plan.nnodes)] if use_torchrun else []
    if "dry_run" in pre.switches:
        from shardtune.launch.report import dry_run_report

        print(dry_run_report(pre, plan, commands))
        return 0
    if not use_torchrun:
        return run_worker(pre)
    if env.master_port is not None and plan.node_rank == 0:
        check_port_free(plan.master_addr, plan.master_port)
    write_launch_config(pre.config, config_path)
    code = run_torchrun(commands[plan.node_rank], plan, Path(pre.config.output_dir or "."), debug)
    if code not in (0, 130) and plan.nnodes > 1:
        remedy = (f"check that {env.scheduler} started one shardtune on each of the {plan.nnodes} nodes"
                  if env.scheduler else f"start every node with NNODES={plan.nnodes}, "
                  f"MASTER_ADDR={plan.master_addr} and MASTER_PORT={plan.master_port}")
        print(f"shardtune: error: the job failed (exit code {code}); if the log shows a rendezvous timeout, a node "
              f"never joined: {remedy}", file=sys.stderr)
    return code


def check_port_free(addr: str, port: int) -> None:
    """Node 0 hosts the rendezvous: a taken MASTER_PORT would otherwise surface as a hang or a trace."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("" if addr not in ("127.0.0.1", "localhost") else addr, port))
        except OSError:
            raise ConfigError(f"MASTER_PORT={port} is already in use on this machine; choose another port "
                              "or unset MASTER_PORT to pick a free one") from None


def write_launch_config(config: TrainConfig, path: Path) -> None:
    """Resolved config for the ranks; written atomically since every node may write the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config_to_dict(config), indent=2))
    tmp.replace(path)


def run_torchrun(argv: list[str], plan: LaunchPlan, run_dir: Path, debug: bool = False) -> int:
    """Run torchrun for this node; unless ``debug``, a failed rank ends up as one line, not three tracebacks."""
    env = dict(os.environ)
    # Two ranks sharing a few cores slow each other down badly when each uses every core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc_per_node)))
    if plan.master_addr in ("127.0.0.1", "localhost") and visible_gpu_count() == 0:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if visible_gpu_count() == 0:
        # CPU ranks keep their weights in host memory. glibc's adaptive mmap threshold keeps freed multi-MB blocks
        # (FSDP and ZeRO-3 gather and free one layer at a time) in its heap, so a sharded run's resident memory
        # grew as large as a replicated one's (measured: FSDP2 LoRA of a 217M model, 1.87 GB -> 0.78 GB per rank).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    print(f"[shardtune] launching: {shlex.join(argv)}", flush=True)
    if debug:
        return wait_for_launcher(subprocess.Popen(argv, env=env, start_new_session=True))
    started = time.time()
    output = LauncherOutput()
    # Only stderr is filtered (torchrun's account of a failure goes there); stdout stays the terminal's.
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.PIPE)
    reader = threading.Thread(target=pump, args=(proc.stderr.fileno(), output, sys.stderr), daemon=True)
    reader.start()
    code = wait_for_launcher(proc)
    # A rank's own child processes can hold the pipe open after torchrun ended: do not wait on them for long.
    reader.join(timeout=5)
    if not reader.is_alive():
        proc.stderr.close()
    return report_launch_failure(code, output, run_dir, started)


def report_launch_failure(code: int, output: LauncherOutput, run_dir: Path, started: float) -> int:
    """One line when no rank could say why it failed (killed, for instance); exit code 2 for bad input."""
    failed = output.failed_ranks()
    if code in (0, 130) or not failed:
        return code
    if not output.any_rank_reported:
        # torchrun stops the other ranks with SIGTERM: the cause is the first failure that is not one of those.
        cause = next((f for f in failed if not f.stopped_by_torchrun), failed[0])
        print(saved_failure_report(run_dir, cause.rank, started) or f"shardtune: error: {cause.describe()}",
              file=sys.stderr, flush=True)
    return 2 if any(f.exit_code == 2 for f in failed) else code


def wait_for_launcher(proc: subprocess.Popen) -> int:
    """Wait for torchrun; Ctrl-C / SIGTERM reach the ranks directly so they finish the step and save.

    torchrun runs in its own session so the terminal's Ctrl-C does not hit it: torchrun treats a signal as a
    failure (a traceback, ranks killed). Ranks that stop on request exit 0; this process then exits 130.
    """
    import signal

    interrupted = []

    def stop_ranks(signum, frame) -> None:
        interrupted.append(signum)
        print("[shardtune] interrupted: the ranks finish this step, save a checkpoint and exit",
              file=sys.stderr, flush=True)
        for pid in child_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGINT, stop_ranks)
    signal.signal(signal.SIGTERM, stop_ranks)
    code = proc.wait()
    if interrupted:
        return 130
    return code if code >= 0 else 128 - code


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (torchrun's ranks), from /proc."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return children


def worker_command(argv: list[str]) -> int:
    """Entry of every rank (`python -m shardtune.train`): validate, join the group, train.

    Under a launcher the rank's process ends here (leave_rank), with the exit code of whatever happened.
    """
    from shardtune.launch.accelerate import config_values_from_accelerate

    rank_env = launch_env.read_rank_env()
    accelerate_values = config_values_from_accelerate(launch_env.accelerate_settings())
    pre = preflight(argv, rank_env.world_size, rank_env.local_world_size, extra_values=accelerate_values)
    if launch_env.elastic_restart_count() > 0 and pre.config.overwrite_output_dir:
        # A restarted worker must continue from the latest checkpoint, never wipe the run it belongs to.
        pre = replace(pre, config=replace(pre.config, overwrite_output_dir=False))
        if rank_env.rank == 0:
            print("[shardtune] restarted by torchrun: resuming instead of overwriting output_dir", flush=True)
    if not launch_env.inside_launcher():
        return run_worker(pre)
    leave_rank(run_rank(pre, rank_env, debug_requested(argv)))


def run_rank(pre: Preflight, rank_env: launch_env.RankEnv, debug: bool) -> int:
    """Train as one rank of a launcher's job; every outcome becomes an exit code, reported as the CLI would."""
    try:
        return run_worker(pre, rank_env)
    except ShardtuneError as err:
        if debug:
            traceback.print_exc()
            return 1
        return report_error(err)
    except KeyboardInterrupt:  # Ctrl-C before the stop handlers were installed
        print("shardtune: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        run_dir, ddp_timeout = Path(pre.config.output_dir or "."), pre.config.ddp_timeout
        if debug:
            save_rank_failure(err, rank_env.rank, run_dir, ddp_timeout)  # the peers' signal handlers look for it
            traceback.print_exc()
            return 1
        return report_rank_failure(err, rank_env.rank, run_dir, ddp_timeout)


def leave_rank(code: int) -> NoReturn:
    """End this rank's process with ``code`` without shutting the interpreter down (os._exit).

    Why: after training, the engines still hold their gloo process group (FSDP2's mesh, DDP's reducer,
    DeepSpeed's groups), so destroy_process_group() cannot join gloo's worker threads (pt_gloo_runloop) and
    they outlive the start of interpreter shutdown. When one of them drops the last C++ reference to a
    collective's work item, ~AsyncWork releases tensors made in Python and must take the GIL; CPython (3.11)
    ends a thread that asks for the GIL once finalization began with pthread_exit, and that forced unwind
    through the noexcept destructor calls std::terminate: "terminate called without an active exception",
    SIGABRT, after a run that finished. It depends on thread scheduling (scripts/repro_gloo_exit_abort.py).
    os._exit skips interpreter shutdown and C++ static destructors; what a rank leaves behind is written
    first: the run closes its own files (Reporter, checkpoints), exit handlers (logging's flush among them)
    run here, and stdout/stderr are flushed.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):  # a closed stream must not change the exit code
            if stream is not None:
                stream.flush()
    os._exit(code)


def run_worker(pre: Preflight, rank_env: launch_env.RankEnv | None = None) -> int:
    from shardtune.engines import build_engine
    from shardtune.train.workflow import StopRequest, run_training

    started = time.time()
    engine = build_engine(pre.config, pre.engine, rank_env)
    if not engine.is_main:
        quiet_this_rank()
    stop = StopRequest()
    install_stop_handlers(stop, Path(pre.config.output_dir or ".") if rank_env is not None else None, started)
    results = run_training(pre.config, engine, stop, memory=memory_probe(pre, engine, rank_env))
    if results.get("interrupted"):
        if engine.is_main:
            print(f"[shardtune] interrupted at step {results['global_step']}; checkpoint saved where save_steps is "
                  "set. Run the same command again to resume.", flush=True)
        # Under a launcher exit 0, so torchrun reports no failure; the launching process says 130.
        return 0 if rank_env is not None else 130
    if engine.is_main:
        print(f"[shardtune] done: final loss {results['final_loss']:.4f} after {results['global_step']} steps "
              f"({results['engine']}, world size {results['world_size']}); outputs in {pre.config.output_dir}",
              flush=True)
    return 0


def memory_probe(pre: Preflight, engine, rank_env: launch_env.RankEnv | None):
    """Measured peak memory from here on, and the estimate to compare it with (train_results.json)."""
    from shardtune.estimate.config import estimate_run_memory
    from shardtune.estimate.measure import mark_memory_baseline
    from shardtune.train.workflow import MemoryProbe

    local_world_size = rank_env.local_world_size if rank_env is not None else 1
    estimate = estimate_run_memory(pre.config, engine.world_size, pre.engine.kind, fsdp_settings=pre.engine.fsdp,
                                   deepspeed_raw=pre.engine.deepspeed_raw, local_world_size=local_world_size,
                                   on_gpu=engine.device.type == "cuda")
    return MemoryProbe(baseline=mark_memory_baseline(), estimate=estimate)


def install_stop_handlers(stop, run_dir: Path | None = None, started: float = 0.0) -> None:
    """Ctrl-C and SIGTERM finish the current step, save a checkpoint and exit instead of killing the run.

    One exception, under a launcher (``run_dir`` set): a signal that arrives after another rank of this run
    wrote its error file is torchrun stopping a failed job. No checkpoint can be saved without every rank, and
    a stuck rank would hold the job until torchrun's SIGKILL 30 s later, so the signal ends the rank at once.
    """
    import signal

    def request_stop(signum, frame) -> None:
        if run_dir is not None and peer_failed_since(run_dir, started):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # dies by the signal, as torchrun expects of a rank it stops
            return
        # No escalation on a second signal: torchrun follows Ctrl-C with SIGTERM to every rank, and it
        # SIGKILLs ranks itself if they take too long.
        if stop.requested:
            return
        stop.requested = True
        print(f"[shardtune] {signal.Signals(signum).name}: stopping after this step and saving a checkpoint",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


def quiet_this_rank() -> None:
    """Only rank 0 talks: other ranks keep warnings and errors (stderr) but drop progress and info output."""
    import logging

    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    for name in ("shardtune", "transformers", "datasets", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ["TQDM_DISABLE"] = "1"
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
