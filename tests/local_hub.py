"""A tiny Hugging Face hub on 127.0.0.1 for tests: the few endpoints huggingface_hub's snapshot_download and
hf_hub_download call (point ``HF_ENDPOINT`` at ``LocalHub.endpoint``).

    GET  /api/{models|datasets}/{org}/{name}/revision/{rev}     repo info: sha and siblings
    GET  /api/{models|datasets}/{org}/{name}/tree/{rev}         the file list (recursive)
    HEAD/GET /{org}/{name}/resolve/{rev}/{path}                 a model file (X-Repo-Commit, ETag, Content-Length)
    HEAD/GET /datasets/{org}/{name}/resolve/{rev}/{path}        a dataset file

A missing repository or revision answers 404 with the X-Error-Code the real hub sends (RepoNotFound,
RevisionNotFound), so huggingface_hub raises its own error types. Every request is recorded in ``requests``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class HubRepo:
    files: dict[str, bytes]
    sha: str = ""
    branches: tuple[str, ...] = ("main",)

    def __post_init__(self) -> None:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + self.files[name])
        self.sha = self.sha or digest.hexdigest()


def blob_oid(content: bytes) -> str:
    """git's blob id, which the hub sends as a small file's ETag and tree oid."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass
class LocalHub:
    """Repositories keyed by (``model`` | ``dataset``, ``org/name``); started by ``start``."""

    repos: dict[tuple[str, str], HubRepo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo_type: str, repo_id: str, files: dict[str, bytes]) -> HubRepo:
        self.repos[(repo_type, repo_id)] = repo = HubRepo(files)
        return repo

    def start(self) -> LocalHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                hub.answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub.answer(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 6 and parts[1] in ("models", "datasets"):
            repo_type, repo_id, action, rev = parts[1][:-1], "/".join(parts[2:4]), parts[4], parts[5]
            repo = self._repo(handler, repo_type, repo_id, rev)
            if repo is None:
                return
            if action == "revision":
                self._json(handler, {"id": repo_id, "sha": repo.sha, "private": False,
                                     "siblings": [{"rfilename": name} for name in repo.files]}, body)
            elif action == "tree":
                self._json(handler, [{"type": "file", "path": name, "size": len(data), "oid": blob_oid(data)}
                                     for name, data in repo.files.items()], body)
            else:
                self._send(handler, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
            return
        repo_type = "dataset" if parts[0] == "datasets" else "model"
        parts = parts[1:] if repo_type == "dataset" else parts
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo(handler, repo_type, "/".join(parts[:2]), parts[3])
            if repo is None:
                return
            name = "/".join(parts[4:])
            if name not in repo.files:
                self._send(handler, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
                return
            data = repo.files[name]
            self._send(handler, 200, data, {"X-Repo-Commit": repo.sha, "ETag": f'"{blob_oid(data)}"',
                                            "Content-Type": "application/octet-stream"}, body)
            return
        self._send(handler, 404, b"{}", {}, body)

    def _repo(self, handler: BaseHTTPRequestHandler, repo_type: str, repo_id: str, rev: str) -> HubRepo | None:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            self._send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"},
                       handler.command != "HEAD")
        elif rev not in (*repo.branches, repo.sha):
            self._send(handler, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"},
                       handler.command != "HEAD")
        else:
            return repo
        return None

    @staticmethod
    def _json(handler: BaseHTTPRequestHandler, value: object, body: bool) -> None:
        LocalHub._send(handler, 200, json.dumps(value).encode(), {"Content-Type": "application/json"}, body)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str],
              body: bool) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
