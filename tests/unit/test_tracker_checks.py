"""Tracker servers and hub downloads are checked before launch, each in a bounded time: MLFLOW_TRACKING_URI's
format and (for a server) that it takes a connection; wandb's credentials and WANDB_BASE_URL's server; a hub id
that offline mode cannot fetch. Every address here is loopback or under the reserved ``.invalid`` domain."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path

import pytest

from shardtune.model import load
from shardtune.train import trackers
from shardtune.train.trackers import REACH_TIMEOUT_S, mlflow_problems, unanswered_reason, wandb_problems


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): a connection there is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def listening_port():
    """A loopback port that takes connections (the kernel completes the handshake) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def timed(check, *args):
    start = time.monotonic()
    found = check(*args)
    return found, time.monotonic() - start


# --- MLflow ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("uri", ["", "/tmp/mlruns", "mlruns", "file:///tmp/mlruns", "databricks", "databricks://prof"])
def test_mlflow_uris_mlflow_reads_without_a_server_pass(uri):
    assert mlflow_problems({"MLFLOW_TRACKING_URI": uri} if uri else {}) == []


def test_an_answering_mlflow_server_passes(listening_port):
    assert mlflow_problems({"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{listening_port}"}) == []


@pytest.mark.parametrize("uri", ["bogus://x", "ftp://host/path", "http://", "https://:5000", "http://host:notaport"])
def test_an_mlflow_uri_mlflow_cannot_read_is_named(uri):
    (problem,) = mlflow_problems({"MLFLOW_TRACKING_URI": uri})
    assert problem.startswith("report_to (mlflow): MLFLOW_TRACKING_URI (") and "not a URI MLflow reads" in problem
    assert "http(s)://host[:port]" in problem and "unset MLFLOW_TRACKING_URI" in problem


def test_an_mlflow_server_that_refuses_is_one_line_naming_the_uri_and_the_fixes():
    uri = f"http://127.0.0.1:{closed_port()}"
    (problem,), took = timed(mlflow_problems, {"MLFLOW_TRACKING_URI": uri})
    assert took < REACH_TIMEOUT_S
    assert problem.startswith(f"report_to (mlflow): MLFLOW_TRACKING_URI ({uri}): ")
    assert "did not answer" in problem and "refused" in problem.lower()
    assert "start the server" in problem and "output_dir/mlruns" in problem and "\n" not in problem


def test_an_unresolvable_mlflow_host_is_named():
    (problem,) = mlflow_problems({"MLFLOW_TRACKING_URI": "https://mlflow.tracker.invalid"})
    assert "mlflow.tracker.invalid" in problem and "did not resolve" in problem


def test_a_password_in_the_mlflow_uri_is_never_shown():
    (problem,) = mlflow_problems({"MLFLOW_TRACKING_URI": f"http://me:hunter2-secret@127.0.0.1:{closed_port()}"})
    assert "hunter2-secret" not in problem and "me:***@127.0.0.1" in problem


@pytest.mark.skipif(importlib.util.find_spec("sqlalchemy") is not None, reason="the database store is installed")
def test_a_database_uri_without_sqlalchemy_names_the_package():
    (problem,) = mlflow_problems({"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"})
    assert "pip install mlflow" in problem and "sqlite:///mlflow.db" in problem


def test_an_mlflow_folder_uri_is_written(tmp_path, monkeypatch):
    """A folder in MLFLOW_TRACKING_URI is MLflow's file store, which MLflow 3 opens only when told."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "store"))
    tracker = trackers.MlflowTracker(tmp_path / "out", "r", {"a": 1})
    tracker.log({"train/loss": 1.0}, 1)
    tracker.close()
    assert list((tmp_path / "store").glob("*/*/meta.yaml"))


# --- the probe ------------------------------------------------------------------------------------------------

def test_a_name_lookup_that_hangs_is_cut_at_the_timeout(monkeypatch):
    """getaddrinfo has no timeout of its own; the probe waits for it at most its timeout."""
    answer = threading.Event()

    def hanging_lookup(*args, **kwargs):
        answer.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "gave up")  # as a real lookup ends, so the thread ends cleanly

    monkeypatch.setattr(trackers.socket, "getaddrinfo", hanging_lookup)
    reason, took = timed(unanswered_reason, "slow.tracker.invalid", 443, 0.5)
    answer.set()
    assert took < 1.5 and "slow.tracker.invalid" in reason and "0.5 s" in reason


def test_the_probe_goes_to_the_proxy_the_client_would_use(monkeypatch, listening_port):
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{listening_port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert mlflow_problems({"MLFLOW_TRACKING_URI": "https://mlflow.tracker.invalid"}) == []


# --- wandb ----------------------------------------------------------------------------------------------------

@pytest.fixture
def no_wandb_login(tmp_path):
    """An environment with no W&B credentials anywhere: an empty netrc, an empty settings folder."""
    (tmp_path / "netrc").write_text("")
    return {"NETRC": str(tmp_path / "netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}


@pytest.mark.parametrize("mode", ["offline", "disabled", "dryrun"])
def test_wandb_offline_or_disabled_needs_nothing(mode, no_wandb_login):
    assert wandb_problems({**no_wandb_login, "WANDB_MODE": mode}) == []


def test_wandb_online_without_credentials_is_one_line_with_the_fixes(no_wandb_login):
    (problem,) = wandb_problems(no_wandb_login)
    assert problem.startswith("report_to (wandb): no W&B credentials for https://api.wandb.ai")
    assert "wandb login" in problem and "WANDB_MODE=offline" in problem and "WANDB_API_KEY" in problem


def test_wandb_credentials_from_the_key_or_netrc_pass(no_wandb_login, tmp_path):
    assert wandb_problems({**no_wandb_login, "WANDB_API_KEY": "k" * 40}) == []
    Path(no_wandb_login["NETRC"]).write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    Path(no_wandb_login["NETRC"]).chmod(0o600)
    assert wandb_problems(no_wandb_login) == []


def test_wandb_offline_in_its_settings_file_needs_nothing(no_wandb_login):
    folder = Path(no_wandb_login["WANDB_CONFIG_DIR"])
    folder.mkdir()
    (folder / "settings").write_text("[default]\nmode = offline\n")
    assert wandb_problems(no_wandb_login) == []


def test_an_unreachable_wandb_base_url_is_named_and_the_key_never_shown(no_wandb_login):
    secret = "wandb-secret-" + "9" * 30
    url = f"http://127.0.0.1:{closed_port()}"
    (problem,), took = timed(wandb_problems, {**no_wandb_login, "WANDB_API_KEY": secret, "WANDB_BASE_URL": url})
    assert took < REACH_TIMEOUT_S and secret not in problem
    assert problem.startswith(f"report_to (wandb): WANDB_BASE_URL ({url}): ") and "did not answer" in problem
    assert "WANDB_MODE=offline" in problem


def test_the_netrc_entry_of_wandb_base_url_counts(no_wandb_login, listening_port):
    Path(no_wandb_login["NETRC"]).write_text(f"machine 127.0.0.1:{listening_port} login u password " + "k" * 40)
    Path(no_wandb_login["NETRC"]).chmod(0o600)
    assert wandb_problems({**no_wandb_login, "WANDB_BASE_URL": f"http://127.0.0.1:{listening_port}"}) == []


def test_a_wandb_base_url_that_is_not_a_url_is_named(no_wandb_login):
    (problem,) = wandb_problems({**no_wandb_login, "WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": "wandb.local"})
    assert problem.startswith("report_to (wandb): WANDB_BASE_URL (wandb.local): not a URL")


# --- hub downloads --------------------------------------------------------------------------------------------

@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    return tmp_path / "hub"


def test_an_uncached_hub_id_in_offline_mode_is_refused_before_launch(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (problem,) = load.offline_hub_problems("someorg/somemodel", False)
    assert problem.startswith("model_name_or_path: someorg/somemodel is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in problem and "hf download someorg/somemodel" in problem
    assert load.offline_hub_problems("someorg/somemodel", True) == []  # a tiny model is built there


def test_a_cached_hub_id_or_an_online_machine_passes(hub_cache, monkeypatch):
    snapshot = hub_cache / "models--someorg--somemodel" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert load.offline_hub_problems("someorg/somemodel", False) == []
    assert load.offline_hub_problems(None, False) == []
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    assert load.offline_hub_problems("someorg/othermodel", False) == []
