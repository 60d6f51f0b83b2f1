"""Where the loop reports to: the run log, throughput, rank logs, checkpoints, evaluation and stop requests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardtune.config.load import config_to_dict
from shardtune.config.schema import TrainConfig
from shardtune.engines.base import Engine
from shardtune.model.compile import CompileReport
from shardtune.startup_gc import collect_between_steps
from shardtune.train import checkpoint
from shardtune.train.loop import Objective, TrainState, evaluate
from shardtune.train.profile import StepProfile
from shardtune.train.rank_log import RankLog, rank_log_path
from shardtune.train.reporting import Reporter
from shardtune.train.throughput import ThroughputMeter

# Metrics the log record has its own fields for; any other metric of a step (a preference objective's rewards/...,
# logps/..., kl) is written beside them.
LOGGED_METRICS = ("loss", "grad_norm", "tokens", "seconds", "aux_loss")


@dataclass
class StopRequest:
    """Set from a signal handler; the loop checks it between steps (all ranks agree through a reduction)."""

    requested: bool = False
    signal_name: str | None = None  # the first stop signal (SIGINT: a person; SIGTERM, SIGUSR1: a scheduler)


def run_name(c: TrainConfig, output_dir: Path) -> str:
    """``run_name``, else the output folder's name (the Trainer's default is the output_dir itself)."""
    return c.run_name or output_dir.resolve().name


@dataclass
class RunHooks:
    """Connects the loop to reporting, evaluation and checkpoints."""

    engine: Engine
    config: TrainConfig
    output_dir: Path
    total_steps: int
    eval_loader: Any
    start_step: int = 0
    stop: StopRequest = field(default_factory=StopRequest)
    objective: Objective | None = None
    estimate_peak_bytes: float | None = None
    baseline_rss_bytes: int | None = None  # resident memory before the model was loaded (CPU runs measure from it)
    compiling: CompileReport | None = None  # torch_compile's bookkeeping
    profile: StepProfile | None = None  # profile_steps: torch.profiler over a few steps

    def __post_init__(self) -> None:
        self.reporter = Reporter(self.output_dir, self.total_steps, enabled=self.engine.is_main,
                                 trackers=self.config.report_to, logging_dir=self.config.logging_dir,
                                 start_step=self.start_step, run_name=run_name(self.config, self.output_dir),
                                 config=config_to_dict(self.config))
        self.last_log_time = self.reporter.start_time
        self.train_losses: list[float] = []
        self.meter = ThroughputMeter(warmup_steps=self.config.throughput_warmup_steps)
        self.rank_log = RankLog(rank_log_path(self.output_dir, self.engine.rank), self.engine.rank,
                                self.engine.device)
        self.rank_log.start(world_size=self.engine.world_size, total_steps=self.total_steps,
                            start_step=self.start_step, estimate_peak_bytes=self.estimate_peak_bytes,
                            baseline_rss_bytes=self.baseline_rss_bytes)
        self.stop_wait = 0.0  # seconds the last stop-flag reduction waited for the other ranks
        self.saver = checkpoint.CheckpointSaver(self.engine, self.output_dir, self.config.save_total_limit,
                                                background=self.config.async_save, on_saved=self.on_saved)

    def on_step(self, state: TrainState, metrics: dict[str, float]) -> None:
        if self.compiling is not None:
            self.compiling.on_step(state.global_step)
        self.rank_log.step(state.global_step, metrics, self.stop_wait)
        self.stop_wait = 0.0
        self.saver.poll()  # a checkpoint written in the background is marked complete once every rank's is
        collect_between_steps(state.global_step)
        record_step(self.meter, self.profile, metrics)
        self.train_losses.append(metrics["loss"])
        self.reporter.step(state.global_step, metrics)

    def on_log(self, state: TrainState, metrics: dict[str, float]) -> None:
        current = time.perf_counter()
        metrics = {**metrics, "seconds": current - self.last_log_time}
        self.last_log_time = current
        seen = state.input_tokens_seen(self.config.include_num_input_tokens_seen)
        extra: dict[str, Any] = {} if seen is None else {"num_input_tokens_seen": seen}
        if "aux_loss" in metrics:
            extra["aux_loss"] = round(metrics["aux_loss"], 6)
        extra.update({key: round(value, 6) for key, value in metrics.items() if key not in LOGGED_METRICS})
        record = self.reporter.log(state.global_step, state.epoch, self.engine.current_lr(), metrics, extra or None)
        state.loss_history.append({"step": state.global_step, "loss": record["loss"]})

    def should_stop(self) -> bool:
        # Ranks may receive the signal at different steps; the sum makes them stop at the same one.
        arrived = time.perf_counter()
        flag = torch.tensor(1.0 if self.stop.requested else 0.0, device=self.engine.device)
        stop = bool(self.engine.all_reduce_sum(flag) > 0)
        self.stop_wait = time.perf_counter() - arrived
        return stop

    def stop_requested(self) -> bool:
        return self.stop.requested

    def on_save(self, state: TrainState) -> None:
        started = time.perf_counter()
        self.rank_log.event("saving", state.global_step)
        self.saver.save(state, model_only=self.config.save_only_model, objective=self.objective)
        self.rank_log.event("save", state.global_step, seconds=round(time.perf_counter() - started, 3))
        self.rank_log.restart_clock()
        self.meter.start()  # saving is not training time

    def on_saved(self, step: int, times: checkpoint.SaveTimes) -> None:
        """A checkpoint became complete: what it held the training for and how long its files took to write."""
        self.rank_log.event("saved", step, blocked_seconds=round(times.blocked, 3),
                            write_seconds=round(times.written, 3))
        self.reporter.log_save(step, times.blocked, times.written, self.config.async_save)

    def finish_saves(self) -> None:
        """The run's end (or stop): the last checkpoint's writes are waited for and it is marked complete."""
        self.saver.finish()
        self.saver.close()

    def on_evaluate(self, state: TrainState) -> None:
        if self.eval_loader is not None:
            started = time.perf_counter()
            self.rank_log.event("evaluating", state.global_step)
            found = self.eval_metrics()
            self.rank_log.event("eval", state.global_step, seconds=round(time.perf_counter() - started, 3))
            self.reporter.log_eval(state.global_step, state.epoch, found.pop("eval_loss"), found)
        self.rank_log.restart_clock()
        self.meter.start()

    def eval_metrics(self) -> dict[str, float]:
        """``eval_loss`` and, for a preference objective, ``eval_rewards/...`` and the like."""
        if self.objective is not None:
            found = self.objective.evaluate(self.engine, self.eval_loader)
            return {f"eval_{key}": round(value, 6) if key != "loss" else value for key, value in found.items()}
        return {"eval_loss": evaluate(self.engine, self.eval_loader, self.config.loss_chunk_size,
                                      self.config.label_smoothing_factor)}


def record_step(meter: ThroughputMeter, profile: StepProfile | None, metrics: dict[str, float]) -> None:
    """The step's time and tokens into the meter, then the profiler's turn. Starting the profiler, and stopping it
    with its summary (tens of seconds for a 0.5B model's trace on an H100), belong to no step: the meter's clock
    restarts after them, or the step after the profiled ones would carry them (4.8k instead of 41k tokens/s
    measured on 2026-11-28)."""
    meter.record(metrics, profiled=profile is not None and profile.active)
    if profile is None:
        return
    was_profiling = profile.active
    profile.after_step()
    if was_profiling or profile.active:
        meter.start()
