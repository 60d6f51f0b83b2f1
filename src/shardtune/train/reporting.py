"""What a run tells the user: progress bar, trainer_log.jsonl, the experiment trackers and the loss plot."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shardtune import run_files
from shardtune.train.trackers import Tracker, open_trackers

LOG_FILE = run_files.LOG
PLOT_FILE = run_files.LOSS_PLOT


class Reporter:
    """Main-rank reporting; every method is a no-op on other ranks."""

    def __init__(self, output_dir: Path, total_steps: int, *, enabled: bool, trackers: list[str],
                 logging_dir: str | None, start_step: int = 0, run_name: str = "",
                 config: dict[str, Any] | None = None) -> None:
        self.output_dir = output_dir
        self.total_steps = total_steps
        self.enabled = enabled
        self.start_time = time.perf_counter()
        self.start_step = start_step
        self.progress = None
        self.trackers: list[Tracker] = []
        if enabled:
            from tqdm.auto import tqdm

            self.progress = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
            self.trackers = open_trackers(trackers, output_dir=output_dir, logging_dir=logging_dir,
                                          run_name=run_name or output_dir.name, config=config or {})

    def step(self, step: int, metrics: dict[str, float]) -> None:
        if self.progress is not None:
            self.progress.update(1)
            shown = {"loss": f"{metrics['loss']:.4f}"}
            if "rewards/accuracies" in metrics:  # preference stages: is the chosen answer ahead?
                shown["acc"] = f"{metrics['rewards/accuracies']:.2f}"
            self.progress.set_postfix(**shown)

    def log(self, step: int, epoch: float, lr: float, metrics: dict[str, float],
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.start_time
        done = max(step - self.start_step, 1)
        record = {
            "current_steps": step,
            "total_steps": self.total_steps,
            "loss": round(metrics["loss"], 6),
            "grad_norm": round(metrics.get("grad_norm", 0.0), 6),
            "learning_rate": lr,
            "epoch": round(epoch, 4),
            "percentage": round(100 * step / self.total_steps, 2),
            "elapsed_time": format_seconds(elapsed),
            "remaining_time": format_seconds(elapsed / done * (self.total_steps - step)),
            "tokens_per_second": round(metrics.get("tokens", 0.0) / max(metrics.get("seconds", elapsed), 1e-9), 2),
            **(extra or {}),
        }
        self.write_record(record)
        self.track({f"train/{key}": record[key] for key in ("loss", "learning_rate", "grad_norm", "tokens_per_second",
                                                             "epoch")}, step)
        return record

    def log_eval(self, step: int, epoch: float, eval_loss: float, extra: dict[str, float] | None = None) -> None:
        """``extra``: an objective's other eval metrics (``eval_rewards/accuracies``, ...)."""
        self.write_record({"current_steps": step, "total_steps": self.total_steps, "eval_loss": eval_loss,
                           "epoch": round(epoch, 4), **(extra or {})})
        self.track({"eval/loss": eval_loss, **{f"eval/{key.removeprefix('eval_')}": value
                                              for key, value in (extra or {}).items()}}, step)

    def log_save(self, step: int, blocked_seconds: float, write_seconds: float, in_background: bool) -> None:
        """A checkpoint became complete: the seconds the training was held for it and its files' write time."""
        self.write_record({"current_steps": step, "total_steps": self.total_steps, "checkpoint": f"checkpoint-{step}",
                           "save_blocked_seconds": round(blocked_seconds, 4),
                           "save_write_seconds": round(write_seconds, 4), "async_save": in_background})

    def track(self, metrics: dict[str, float], step: int) -> None:
        """The same metrics to every tracker of ``report_to``."""
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def write_record(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.output_dir / LOG_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def plot_loss(output_dir: Path) -> Path | None:
    """Draw training (and eval) loss from trainer_log.jsonl into training_loss.png."""
    log = output_dir / LOG_FILE
    if not log.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    train = [(r["current_steps"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["current_steps"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train, strict=False), label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=False), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"training loss of {output_dir.name}")
    ax.legend()
    path = output_dir / PLOT_FILE
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
