"""Experiment trackers rank 0 writes to (``report_to``): TensorBoard, Weights & Biases and MLflow.

Each gets the same metrics under the same names (``train/loss``, ``train/learning_rate``, ``train/grad_norm``,
``train/tokens_per_second``, ``train/epoch``, ``eval/loss``, ...) and the resolved config. wandb and mlflow are
optional packages (extras ``shardtune[wandb]`` / ``shardtune[mlflow]``): a run naming one that is missing is refused
before launch with the install line. Their usual variables apply: WANDB_PROJECT, WANDB_MODE=offline, WANDB_DIR;
MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME. Without MLFLOW_TRACKING_URI, MLflow writes a local file store in
``output_dir/mlruns`` (`mlflow ui --backend-store-uri output_dir/mlruns` shows it).

Before launch (``tracker_problems``, so ``shardtune check`` says it too) each server a tracker would wait on is
asked once, within ``REACH_TIMEOUT_S``: MLFLOW_TRACKING_URI's format and, for a server, that it takes a TCP
connection; wandb's credentials (never sent, never shown) and, when WANDB_BASE_URL names a server, that it takes one.
Without these, rank 0 meets a missing server after the model has loaded, and MLflow retries it for minutes.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import importlib.util
import json
import netrc
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import SplitResult, urlsplit

from shardtune.errors import ConfigError
from shardtune.paths import home_expanded

# tracker -> (module, the pinned package, the extra that installs it)
OPTIONAL_TRACKERS = {"wandb": ("wandb", "wandb==0.31.0", "wandb"),
                     "mlflow": ("mlflow", "mlflow-skinny==3.17.2", "mlflow")}
_PARAM_VALUE_LIMIT = 6000  # MLflow refuses longer parameter values
# How long a tracker server may take to resolve and take a TCP connection before launch: a live server on the
# network answers in milliseconds, and a run should not wait on one that does not.
REACH_TIMEOUT_S = 3.0
WANDB_DEFAULT_URL = "https://api.wandb.ai"
_WANDB_QUIET_MODES = ("offline", "disabled", "dryrun")  # modes that write locally, or nothing, and ask no server
# MLflow's own stores (mlflow/tracking/_tracking_service/utils.py); plugins add theirs as entry points.
_MLFLOW_SERVERLESS = ("", "file", "databricks", "databricks-uc", "uc")
_MLFLOW_DATABASES = ("postgresql", "mysql", "sqlite", "mssql")
_MLFLOW_FORMATS = "a folder, file:///path, http(s)://host[:port], databricks or sqlite:///file.db"


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


def wanted_trackers(report_to: list[str]) -> list[str]:
    """The trackers ``report_to`` names; ``all`` is TensorBoard (the one that needs no account or server)."""
    names = {"tensorboard" if name == "all" else name for name in report_to}
    return [name for name in ("tensorboard", "wandb", "mlflow") if name in names]


def tracker_problems(report_to: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """One problem per tracker of ``report_to`` whose package is not installed (with the line that installs it), or
    whose server or credentials would leave rank 0 waiting or failing after launch."""
    env = os.environ if environ is None else environ
    problems = []
    for name in wanted_trackers(report_to):
        if name in OPTIONAL_TRACKERS and importlib.util.find_spec(OPTIONAL_TRACKERS[name][0]) is None:
            module, package, extra = OPTIONAL_TRACKERS[name]
            problems.append(f"report_to ({name}): the {module} package is not installed; install it with "
                            f"pip install 'shardtune[{extra}]' (or pip install {package}), or remove {name}")
        elif name == "mlflow":
            problems += mlflow_problems(env)
        elif name == "wandb":
            problems += wandb_problems(env)
    return problems


def mlflow_problems(env: Mapping[str, str]) -> list[str]:
    """MLFLOW_TRACKING_URI in a form MLflow reads and, for a tracking server, one that takes a connection."""
    uri = env.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        return []  # MlflowTracker writes output_dir/mlruns
    head = f"report_to (mlflow): MLFLOW_TRACKING_URI ({shown_url(uri)})"
    unset = "unset MLFLOW_TRACKING_URI to write output_dir/mlruns"
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in _MLFLOW_SERVERLESS or (len(scheme) == 1 and scheme.isalpha()):  # a: is a Windows drive
        return []
    if scheme.split("+")[0] in _MLFLOW_DATABASES:
        if importlib.util.find_spec("sqlalchemy") is None:
            return [f"{head}: a database store needs the full MLflow package (mlflow-skinny has no SQLAlchemy); "
                    f"pip install mlflow, or {unset}"]
        return []
    if scheme not in ("http", "https"):
        if scheme in _mlflow_plugin_schemes():
            return []
        return [f"{head}: not a URI MLflow reads; use {_MLFLOW_FORMATS}, or {unset}"]
    address = _host_port(parts)
    if address is None:
        return [f"{head}: not a URI MLflow reads (no host, or a port that is not a number); use "
                f"{_MLFLOW_FORMATS}, or {unset}"]
    reason = server_reason(parts, *address)
    if reason is None:
        return []
    return [f"{head}: the tracking server did not answer ({reason}); start the server, fix the URI, or {unset}"]


def _mlflow_plugin_schemes() -> set[str]:
    return {entry.name for entry in importlib.metadata.entry_points(group="mlflow.tracking_store")}


def wandb_problems(env: Mapping[str, str]) -> list[str]:
    """An online wandb run needs credentials for its server (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE or a netrc
    entry) and, when WANDB_BASE_URL names one, a server that takes a connection. Offline and disabled ask nothing."""
    settings = _wandb_settings(env)
    mode = (env.get("WANDB_MODE") or settings.get("mode", "online")).strip().lower()
    if mode in _WANDB_QUIET_MODES:
        return []
    given_url = env.get("WANDB_BASE_URL", "").strip()
    url = (given_url or settings.get("base_url") or WANDB_DEFAULT_URL).rstrip("/")
    parts = urlsplit(url)
    address = _host_port(parts) if parts.scheme in ("http", "https") else None
    offline = "or set WANDB_MODE=offline to log to output_dir/wandb (wandb sync uploads it later)"
    if address is None:
        return [f"report_to (wandb): WANDB_BASE_URL ({shown_url(url)}): not a URL wandb reads; use "
                f"https://host[:port], {offline}"]
    problems = []
    if not (env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE") or _netrc_has(env, parts.netloc)):
        problems.append(f"report_to (wandb): no W&B credentials for {shown_url(url)} (WANDB_API_KEY is unset and "
                        f"{_netrc_path(env)} has no entry for {parts.netloc}); run `wandb login`, set "
                        f"WANDB_API_KEY, {offline}")
    reason = server_reason(parts, *address) if given_url else None  # the default server is not probed
    if reason is not None:
        problems.append(f"report_to (wandb): WANDB_BASE_URL ({shown_url(url)}): the W&B server did not answer "
                        f"({reason}); start it, fix the URL, {offline}")
    return problems


def _wandb_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The [default] section of wandb's global settings file, then ./wandb/settings (written by `wandb offline`,
    `wandb login --host`); the environment overrides both, as in wandb."""
    folder = env.get("WANDB_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "wandb")
    found: dict[str, str] = {}
    for path in (Path(folder) / "settings", Path("wandb") / "settings"):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue  # wandb treats a file it cannot read as empty
        if parser.has_section("default"):
            found.update(parser["default"])
    return found


def _netrc_path(env: Mapping[str, str]) -> Path:
    """The netrc file wandb reads: NETRC, else ~/.netrc, else ~/_netrc when only that exists."""
    if env.get("NETRC"):
        return home_expanded(env["NETRC"])
    unix, windows = Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()
    return windows if windows.exists() and not unix.exists() else unix


def _netrc_has(env: Mapping[str, str], netloc: str) -> bool:
    """Whether the netrc file has a password for ``netloc`` (the password itself is never kept)."""
    try:
        entry = netrc.netrc(str(_netrc_path(env))).authenticators(netloc)
    except (netrc.NetrcParseError, OSError):
        return False  # wandb warns and reads no credentials from it either
    return bool(entry and entry[2])


def shown_url(url: str) -> str:
    """``url`` with any password in it replaced by ***, so a refusal can print it."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.netloc.rsplit('@', 1)[1]}"
    return parts._replace(netloc=netloc).geturl()


def _host_port(parts: SplitResult) -> tuple[str, int] | None:
    """The host and port an http(s) URL connects to; None when it has no host or an unreadable port."""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname else None


def server_reason(parts: SplitResult, host: str, port: int) -> str | None:
    """Why the first hop toward an http(s) server (the proxy the client would use, else the server) did not take
    a connection within REACH_TIMEOUT_S; None when it did. Nothing is sent over the connection."""
    proxy = urllib.request.getproxies_environment().get(parts.scheme)
    # proxy_bypass_environment reads NO_PROXY as requests does; typeshed does not list it.
    if proxy and not urllib.request.proxy_bypass_environment(host):  # type: ignore[attr-defined]
        proxy_address = _host_port(urlsplit(proxy if "://" in proxy else f"http://{proxy}"))
        if proxy_address is not None:
            reason = unanswered_reason(*proxy_address, REACH_TIMEOUT_S)
            return None if reason is None else f"through the proxy {shown_url(proxy)}: {reason}"
    return unanswered_reason(host, port, REACH_TIMEOUT_S)


def unanswered_reason(host: str, port: int, timeout: float) -> str | None:
    """Why ``host:port`` did not take a TCP connection within ``timeout`` seconds (name lookup included); None
    when it did."""
    deadline = time.monotonic() + timeout
    addresses = _resolved(host, port, timeout)
    if isinstance(addresses, str):
        return addresses
    reason = f"{host}:{port} gave no address"
    for family, kind, proto, _, address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"{host}:{port} took no connection within {timeout:g} s"
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(left)
                sock.connect(address)
            return None
        except TimeoutError:
            reason = f"{host}:{port} took no connection within {timeout:g} s"
        except OSError as err:
            reason = f"{host}:{port}: {err.strerror or err}"
    return reason


def _resolved(host: str, port: int, timeout: float) -> list[tuple[Any, ...]] | str:
    """getaddrinfo's addresses, or why there are none. getaddrinfo takes no timeout, so it runs in a daemon thread
    that is waited on for ``timeout`` at most (and left to finish on its own)."""
    found: list[list[tuple[Any, ...]] | str] = []

    def look_up() -> None:
        try:
            found.append(list(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))
        except OSError as err:
            found.append(f"the name {host} did not resolve ({err.strerror or err})")

    thread = threading.Thread(target=look_up, name=f"resolve {host}", daemon=True)
    thread.start()
    thread.join(timeout)
    return found[0] if found else f"the name {host} did not resolve within {timeout:g} s"


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

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (output_dir / "mlruns").resolve().as_uri()
        scheme = urlsplit(uri).scheme
        if scheme in ("", "file") or len(scheme) == 1:
            # MLflow 3 keeps the file store only on request; a folder (ours, or one the URI names) is that request.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
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
