"""Registry entries whose data lives on a hub, and ``dataset_dir: REMOTE:org/name``, as LLaMA-Factory reads them.

An entry names its repository with ``hf_hub_url`` (or ``ms_hub_url`` / ``om_hub_url``: LLaMA-Factory's choice
between them, ``USE_MODELSCOPE_HUB`` / ``USE_OPENMIND_HUB``, is kept). The repository (only its ``folder`` /
``subset`` part) is brought into the hub's cache once per node (shardtune.hub) and then read like a local copy:
``folder``, ``subset`` and ``split`` pick inside it exactly as for a local folder (data/datafiles.py), and
``revision`` pins a branch, tag or commit.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from shardtune.hub import HubError, fetch_hub_repo

HUB_URL_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url")
# Entries LLaMA-Factory downloads with a script or from a bucket: refused.
UNREAD_SOURCE_KEYS = ("script_url", "cloud_file_name")
# key -> (hub, client module, the variable that makes LLaMA-Factory prefer it, pip package)
CLIENTS = {"ms_hub_url": ("ModelScope", "modelscope", "USE_MODELSCOPE_HUB", "modelscope"),
           "om_hub_url": ("Modelers (openMind)", "openmind_hub", "USE_OPENMIND_HUB", "openmind-hub")}
REMOTE = "REMOTE:"


def is_hub_entry(raw: dict[str, Any]) -> bool:
    return any(key in raw for key in (*HUB_URL_KEYS, *UNREAD_SOURCE_KEYS))


def hub_source_key(raw: dict[str, Any]) -> str:
    """The key LLaMA-Factory downloads the entry from (parser.get_dataset_list's order)."""
    for key, (_, _, switch, _) in CLIENTS.items():
        if key in raw and (_is_on(os.environ.get(switch)) or "hf_hub_url" not in raw):
            return key
    return next(key for key in (*HUB_URL_KEYS, *UNREAD_SOURCE_KEYS) if key in raw)


def fetch_hub_entry(raw: dict[str, Any], where: str) -> tuple[Path | None, list[str]]:
    """The cached folder an entry's files are picked from (downloaded first when missing), or its problem."""
    key = hub_source_key(raw)
    if key in UNREAD_SOURCE_KEYS:
        return None, [f"{where} is downloaded from '{key}' ({raw[key]}), which shardtune does not read: download "
                      "it, copy it next to dataset_info.json, and in the entry replace it by \"file_name\" naming "
                      "that local file or folder"]
    repo_id, revision = raw[key], raw.get("revision")
    if not isinstance(repo_id, str) or not repo_id.strip() or repo_id.count("/") > 1:
        return None, [f"{where}: {key} must be a hub id ('org/name', or a legacy 'name'), got {repo_id!r}"]
    inside = "/".join(part for part in (raw.get("folder"), raw.get("subset")) if part)
    patterns = [f"{inside}/*"] if inside else None
    if key in CLIENTS:
        hub, module, _, package = CLIENTS[key]
        if importlib.util.find_spec(module) is None:
            return None, [f"{where} is read from {hub} ({key}: {repo_id}), whose client is not installed: "
                          f"`pip install {package}`, or give the entry an hf_hub_url"]
        return _client_snapshot(key, repo_id, revision, patterns, where)
    try:
        return fetch_hub_repo(repo_id, repo_type="dataset", revision=revision, allow_patterns=patterns,
                              what=f"{where}: {key}"), []
    except HubError as err:
        return None, [str(err)]


def dataset_folder(dataset_dir: str | Path) -> tuple[Path, list[str]]:
    """``dataset_dir`` as a local folder: ``REMOTE:org/name`` (LLaMA-Factory's registry on the hub) is the cached
    snapshot of that dataset repository, its dataset_info.json and data files together."""
    text = str(dataset_dir)
    if not text.startswith(REMOTE):
        return Path(dataset_dir), []
    try:
        return fetch_hub_repo(text[len(REMOTE):], repo_type="dataset", what=f"dataset_dir {text}"), []
    except HubError as err:
        return Path(), [str(err)]


def _client_snapshot(key: str, repo_id: str, revision: str | None, patterns: list[str] | None,
                     where: str) -> tuple[Path | None, list[str]]:
    """ModelScope's or openMind's own snapshot download (not tested here: neither client is installed in CI)."""
    hub = CLIENTS[key][0]
    try:
        if key == "ms_hub_url":
            from modelscope import dataset_snapshot_download  # type: ignore[import-not-found]

            return Path(dataset_snapshot_download(repo_id, revision=revision or "master",
                                                  allow_file_pattern=patterns)), []
        from openmind_hub import snapshot_download  # type: ignore[import-not-found]

        return Path(snapshot_download(repo_id, repo_type="dataset", revision=revision or "main",
                                      allow_patterns=patterns)), []
    except Exception as err:  # each client raises its own types
        return None, [f"{where}: {hub} did not give {repo_id} ({str(err).splitlines()[0] if str(err) else err!r})"]


def _is_on(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "y", "yes", "on")
