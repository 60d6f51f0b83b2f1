"""The rank entry (`python -m shardtune.train`): read the plan, join the process group, train, leave.

Started by shardtune's own torchrun, a rank reads the plan the launching host wrote and trusts it: no second
validation. Started by the user's own launcher (`torchrun`, `accelerate launch`, `deepspeed` on a YAML) no host has
checked anything, so the rank runs the whole preflight itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from shardtune.config.schema import BITSANDBYTES_OPTIMIZERS
from shardtune.errors import ShardtuneError, debug_requested, report_error, write_stderr_line
from shardtune.launch import env as launch_env
from shardtune.launch.failures import peer_failed_since, report_rank_failure, save_rank_failure, save_stopped_after_peer
from shardtune.launch.preemption import STOP_SIGNALS, exit_code_for
from shardtune.launch.preflight import RunPlan, preflight, read_run_plan
from shardtune.world import RankEnv, WorldLayout


def worker_command(argv: list[str]) -> int:
    """Train as this process's rank; under a launcher the process ends here (leave_rank) with the run's exit code."""
    rank_env = launch_env.read_rank_env()
    plan = resumed_after_restart(rank_plan(argv, rank_env), launch_env.elastic_restart_count(), rank_env.rank,
                                 "torchrun")
    if not launch_env.inside_launcher():
        return run_worker(plan)
    with lock_for_users_launcher(argv, plan, rank_env):
        code = run_rank(plan, rank_env, debug_requested(argv))
    leave_rank(code)


def lock_for_users_launcher(argv: list[str], plan: RunPlan, rank_env: RankEnv) -> contextlib.AbstractContextManager:
    """Under the user's own launcher no shardtune process holds the run lock: global rank 0 takes it for the job.
    Under shardtune's own torchrun (the rank reads the launching host's plan) the launching process holds it."""
    started_by_shardtune = bool(argv) and read_run_plan(argv[0]) is not None
    if started_by_shardtune or rank_env.rank != 0 or not plan.config.output_dir:
        return contextlib.nullcontext()
    from shardtune.launch.run_lock import holding_run_lock

    return holding_run_lock(plan.run_dir, launch_env.run_job_id())


def resumed_after_restart(plan: RunPlan, restarts: int, rank: int, launcher: str) -> RunPlan:
    """A worker that ``launcher`` restarted must continue from the latest checkpoint, never wipe the run it
    belongs to: overwrite_output_dir applies to the first attempt only."""
    if restarts == 0:
        return plan
    if rank == 0:
        print(f"[shardtune] restarted by {launcher} (restart {restarts}): resuming from the latest complete "
              "checkpoint" + (" instead of overwriting output_dir" if plan.config.overwrite_output_dir else ""),
              flush=True)
    return replace(plan, config=replace(plan.config, overwrite_output_dir=False))


def rank_plan(argv: list[str], rank_env: RankEnv) -> RunPlan:
    """The launching host's plan when shardtune started this rank; else this rank's own preflight."""
    resolved = read_run_plan(argv[0]) if argv else None
    if resolved is not None:
        config, engine = resolved
        layout = WorldLayout.of_ranks(rank_env.world_size, rank_env.local_world_size,
                                      config.per_device_train_batch_size, config.gradient_accumulation_steps)
        return RunPlan(config, engine, layout)
    from shardtune.launch.accelerate import config_values_from_accelerate

    accelerate_values = config_values_from_accelerate(launch_env.accelerate_settings())
    layout = WorldLayout.of_ranks(rank_env.world_size, rank_env.local_world_size)
    return preflight(argv, layout.nodes, layout.procs_per_node, defaults=accelerate_values,
                     announce=not launch_env.inside_launcher())


def run_rank(plan: RunPlan, rank_env: RankEnv, debug: bool) -> int:
    """Train as one rank of a launcher's job; every outcome becomes an exit code, reported as the CLI would."""
    try:
        return run_worker(plan, rank_env)
    except ShardtuneError as err:
        if debug:
            traceback.print_exc()
            return 1
        return report_error(err)
    except KeyboardInterrupt:  # Ctrl-C before the stop handlers were installed
        print("shardtune: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            save_rank_failure(err, rank_env.rank, plan.run_dir, plan.config.ddp_timeout)  # peers look for it
            traceback.print_exc()
            return 1
        return report_rank_failure(err, rank_env.rank, plan.run_dir, plan.config.ddp_timeout)


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


def run_worker(plan: RunPlan, rank_env: RankEnv | None = None) -> int:
    from shardtune.cpu_kernel_caches import bound_cpu_kernel_caches
    from shardtune.engines import build_engine
    from shardtune.startup_gc import pause_collection
    from shardtune.train.workflow import StopRequest, run_training

    pause_collection()  # resumed before the first step (train/workflow.py)
    bound_cpu_kernel_caches()  # before the first matmul, which reads them
    started = time.time()
    leave_out_bitsandbytes(plan.config)
    engine = build_engine(plan.config, plan.engine, rank_env)
    if not engine.is_main:
        quiet_this_rank()
    stop = StopRequest()
    install_stop_handlers(stop, plan.run_dir if rank_env is not None else None, started, engine.rank)
    results = run_training(plan.config, engine, stop, memory=memory_probe(plan, engine, rank_env))
    if results.get("interrupted"):
        if engine.is_main:
            print(f"[shardtune] interrupted at step {results['global_step']}; checkpoint saved where save_steps is "
                  "set. Run the same command again to resume.", flush=True)
        # Under a launcher exit 0, so torchrun reports no failure; the launching process says 130 (Ctrl-C) or asks
        # for a requeue (a scheduler's SIGTERM / SIGUSR1: launch/preemption.py).
        return 0 if rank_env is not None else exit_code_for(stop.signal_name)
    if results.get("predict_only"):
        if engine.is_main:
            model = ", ".join([plan.config.model_name_or_path or "", *plan.config.adapter_name_or_path])
            print(f"[shardtune] done: predictions of {model} ({engine.name}, world size {engine.world_size}) in "
                  f"{plan.config.output_dir}", flush=True)
        return 0
    if engine.is_main:
        print(f"[shardtune] done: final loss {results['final_loss']:.4f} after {results['global_step']} steps "
              f"({results['engine']}, world size {results['world_size']}); outputs in {plan.config.output_dir}",
              flush=True)
    return 0


def needs_bitsandbytes(config) -> bool:
    """Quantized loads and bitsandbytes' optimizers (adamw_8bit, the paged ones; GaLore's and APOLLO's packages
    import it)."""
    return bool(config.quantization_bit or config.ref_model_quantization_bit
                or config.optim in BITSANDBYTES_OPTIMIZERS
                or config.use_galore or config.use_apollo or config.use_adam_mini)


def leave_out_bitsandbytes(config) -> None:
    """Why: peft imports bitsandbytes whenever it is installed, and bitsandbytes imports torch's inductor at import
    (1.3-1.7 s per rank on this CPU before anything trains; benchmarks/README.md). A run that quantizes nothing and
    uses no 8-bit optimizer never calls it, so this rank records it as absent (``sys.modules[name] = None``, which
    Python's import system and ``importlib.util.find_spec`` read as not installed) and peft's optional import skips
    it. A rank that already imported it keeps it."""
    if not needs_bitsandbytes(config):
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]


def memory_probe(plan: RunPlan, engine, rank_env: RankEnv | None):
    """Measured peak memory from here on, and the estimate to compare it with (train_results.json)."""
    from shardtune.estimate.config import estimate_run_memory
    from shardtune.estimate.measure import mark_memory_baseline
    from shardtune.train.workflow import MemoryProbe

    local_world_size = rank_env.local_world_size if rank_env is not None else 1
    estimate = estimate_run_memory(plan.config, engine.world_size, plan.engine.kind, fsdp_settings=plan.engine.fsdp,
                                   deepspeed_raw=plan.engine.deepspeed_raw, local_world_size=local_world_size,
                                   on_gpu=engine.device.type == "cuda")
    return MemoryProbe(baseline=mark_memory_baseline(), estimate=estimate)


def install_stop_handlers(stop, run_dir: Path | None = None, started: float = 0.0, rank: int = 0) -> None:
    """Ctrl-C, SIGTERM and SIGUSR1 finish the current step, save a checkpoint and exit instead of killing the run.

    One exception, under a launcher (``run_dir`` set): a signal that arrives after another rank of this run
    wrote its error file is torchrun stopping a failed job. No checkpoint can be saved without every rank, and
    a stuck rank would hold the job until torchrun's SIGKILL 30 s later, so the signal ends the rank at once,
    leaving a one-line report that says it was stopped (the page lists every rank's fate).
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        # Ray Train runs a rank's function in a thread of its worker actor, and signals belong to Ray there:
        # a Ray run is stopped through Ray and resumes from its latest checkpoint when started again.
        return

    def request_stop(signum, frame) -> None:
        if run_dir is not None and peer_failed_since(run_dir, started):
            save_stopped_after_peer(rank, run_dir, started)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # dies by the signal, as torchrun expects of a rank it stops
            return
        # No escalation on a second signal: torchrun follows Ctrl-C with SIGTERM to every rank, and it
        # SIGKILLs ranks itself if they take too long.
        if stop.requested:
            return
        stop.requested = True
        name = signal.Signals(signum).name
        stop.signal_name = name
        write_stderr_line(f"[shardtune] {name}: stopping after this step and saving a checkpoint")

    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, request_stop)


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
