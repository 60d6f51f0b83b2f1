"""Experiment trackers rank 0 writes to (``report_to``): TensorBoard, Weights & Biases and MLflow.

Each gets the same metrics under the same names (``train/loss``, ``train/learning_rate``, ``train/grad_norm``,
``train/tokens_per_second``, ``train/epoch``, ``eval/loss``, ...) and the resolved config. wandb and mlflow are
optional packages (extras ``shardtune[wandb]`` / ``shardtune[mlflow]``): a run naming one that is missing is refused
before launch with the install line. Their usual variables apply: WANDB_PROJECT, WANDB_MODE=offline, WANDB_DIR;
MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME. Without MLFLOW_TRACKING_URI, MLflow writes a local file store in
``output_dir/mlruns`` (`mlflow ui --backend-store-uri output_dir/mlruns` shows it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from shardtune.errors import ConfigError

# tracker -> (module, the pinned package, the extra that installs it)
OPTIONAL_TRACKERS = {"wandb": ("wandb", "wandb==0.31.0", "wandb"),
                     "mlflow": ("mlflow", "mlflow-skinny==3.17.2", "mlflow")}
_PARAM_VALUE_LIMIT = 6000  # MLflow refuses longer parameter values


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


def wanted_trackers(report_to: list[str]) -> list[str]:
    """The trackers ``report_to`` names; ``all`` is TensorBoard (the one that needs no account or server)."""
    names = {"tensorboard" if name == "all" else name for name in report_to}
    return [name for name in ("tensorboard", "wandb", "mlflow") if name in names]


def tracker_problems(report_to: list[str]) -> list[str]:
    """One problem per tracker of ``report_to`` whose package is not installed, with the line that installs it."""
    problems = []
    for name in wanted_trackers(report_to):
        if name in OPTIONAL_TRACKERS and importlib.util.find_spec(OPTIONAL_TRACKERS[name][0]) is None:
            module, package, extra = OPTIONAL_TRACKERS[name]
            problems.append(f"report_to ({name}): the {module} package is not installed; install it with "
                            f"pip install 'shardtune[{extra}]' (or pip install {package}), or remove {name}")
    return problems


def open_trackers(report_to: list[str], *, output_dir: Path, logging_dir: str | None, run_name: str,
                  config: dict[str, Any]) -> list[Tracker]:
    """Start every tracker ``report_to`` names (rank 0 only); each has the resolved config."""
    opened: list[Tracker] = []
    for name in wanted_trackers(report_to):
        if name == "tensorboard":
            opened.append(TensorBoardTracker(logging_dir or str(output_dir / "runs"), run_name, config))
        elif name == "wandb":
            opened.append(WandbTracker(output_dir, run_name, config))
        elif name == "mlflow":
            opened.append(MlflowTracker(output_dir, run_name, config))
    return opened


class TensorBoardTracker:
    def __init__(self, log_dir: str, run_name: str, config: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("report_to (tensorboard) needs the tensorboard package: pip install tensorboard") \
                from None
        self.writer = SummaryWriter(log_dir=log_dir)
        self.writer.add_text("run_name", run_name)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        output_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardtune"), name=run_name, config=config,
                              dir=os.environ.get("WANDB_DIR", str(output_dir)))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps the file store only on request; it is the store that needs no server or database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (output_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(uri)
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "shardtune")
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(key, _param_value(value)) for key, value in sorted(config.items())]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_dict(self.run_id, config, "shardtune_config.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now, step)
                                                    for key, value in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_PARAM_VALUE_LIMIT]
