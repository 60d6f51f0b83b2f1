"""What a run tells the user: progress bar, trainer_log.jsonl, tensorboard events and the loss plot."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shardtune import run_files
from shardtune.errors import ConfigError

LOG_FILE = run_files.LOG
PLOT_FILE = run_files.LOSS_PLOT


class Reporter:
    """Main-rank reporting; every method is a no-op on other ranks."""

    def __init__(self, output_dir: Path, total_steps: int, *, enabled: bool, trackers: list[str],
                 logging_dir: str | None, start_step: int = 0, run_name: str = "") -> None:
        self.output_dir = output_dir
        self.total_steps = total_steps
        self.enabled = enabled
        self.start_time = time.perf_counter()
        self.start_step = start_step
        self.progress = None
        self.tensorboard = None
        if enabled:
            from tqdm.auto import tqdm

            self.progress = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
            if "tensorboard" in trackers or "all" in trackers:
                self.tensorboard = open_tensorboard(logging_dir or str(output_dir / "runs"))
                self.tensorboard.add_text("run_name", run_name or output_dir.name)

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
        if self.tensorboard is not None:
            for key in ("loss", "learning_rate", "grad_norm", "tokens_per_second"):
                self.tensorboard.add_scalar(f"train/{key}", record[key], step)
        return record

    def log_eval(self, step: int, epoch: float, eval_loss: float, extra: dict[str, float] | None = None) -> None:
        """``extra``: an objective's other eval metrics (``eval_rewards/accuracies``, ...)."""
        self.write_record({"current_steps": step, "total_steps": self.total_steps, "eval_loss": eval_loss,
                           "epoch": round(epoch, 4), **(extra or {})})
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("eval/loss", eval_loss, step)

    def write_record(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.output_dir / LOG_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def open_tensorboard(log_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("report_to (tensorboard) needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(log_dir=log_dir)


# Trackers LLaMA-Factory users name that shardtune does not write to. Accepting them would leave the user with no
# run in their tracker and no word why, so they are refused before launch. Neither package is installed in the
# environment shardtune is built and tested in, so an integration could not be tested.
REFUSED_TRACKERS = {
    "wandb": "shardtune does not send metrics to Weights & Biases (wandb is not installed here, so no integration "
             "is built or tested); use report_to: tensorboard and upload its folder with "
             "`wandb sync --sync-tensorboard <logging_dir>`, or report_to: none",
    "mlflow": "shardtune does not send metrics to MLflow (mlflow is not installed here, so no integration is built "
              "or tested); use report_to: tensorboard, or report_to: none",
}


def tracker_problems(report_to: list[str]) -> list[str]:
    """One problem per tracker of ``report_to`` that shardtune would not write to."""
    return [f"report_to ({name}): {REFUSED_TRACKERS[name]}" for name in report_to if name in REFUSED_TRACKERS]


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
