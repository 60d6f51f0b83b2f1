"""The page's HTTP side (Starlette): JSON about the runs under ROOT, a server-sent event stream per run, and the
actions (check, launch, stop). Every API request needs the token and comes from the page itself (guard.py). Only
run folders under ROOT are read, never through a symbolic link (beneath.py); the only files served as they are come
from this package's static/ folder."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from shardtune import run_files
from shardtune.web.form import form_fields
from shardtune.web.guard import RequestGuard, ServedNames, served_names
from shardtune.web.processes import (
    LaunchRequest,
    check_request,
    launch_detached,
    parse_launch_request,
    stop_run,
)
from shardtune.web.runs import RunWatcher, config_diff, config_of, find_runs, is_run_folder, node_commands, read_json

STATIC = Path(__file__).parent / "static"
EVENT_INTERVAL = 0.5  # seconds between looks at a watched run's files


class WebState:
    """ROOT and the watchers of the runs the page looks at (so each look reads only new lines)."""

    def __init__(self, root: Path, stop_grace: float) -> None:
        self.root = root.resolve()
        self.stop_grace = stop_grace
        self.watchers: dict[Path, RunWatcher] = {}
        self.lock = threading.Lock()

    def run_folder(self, relative: str | None) -> Path | None:
        """The run folder ``relative`` names under ROOT, or None (outside ROOT, missing, or not a run)."""
        if relative is None:
            return None
        try:
            folder = (self.root / relative).resolve()
            if not folder.is_relative_to(self.root) or not folder.is_dir() or not is_run_folder(folder):
                return None
        except (OSError, ValueError, RuntimeError):  # a NUL in the name, a loop of links: no such run either
            return None
        return folder

    def run_id(self, folder: Path) -> str:
        return folder.relative_to(self.root).as_posix() or "."

    def watcher(self, folder: Path) -> RunWatcher:
        with self.lock:
            return self.watchers.setdefault(folder, RunWatcher(folder))

    def detail(self, folder: Path) -> dict[str, Any]:
        summary = self.watcher(folder).summary()
        summary["id"] = self.run_id(folder)
        summary["nodes"] = node_commands(summary["launch"])
        summary["log_size"] = _size(folder / run_files.LOG)
        stop = read_json(folder, run_files.STOP_REPORT)
        summary["stop"] = stop if stop and summary["started"] and stop.get("requested", 0) >= summary["started"] \
            else None
        return summary

    def listing(self) -> list[dict[str, Any]]:
        """A row per run under ROOT; through the watchers, so a poll of the list reads only new lines too."""
        found, folders = [], find_runs(self.root)
        for folder in folders:
            s = self.watcher(folder).summary()
            losses = [r["loss"] for r in s["ranks"] if r["loss"] is not None]
            found.append({"id": self.run_id(folder), "name": s["name"], "state": s["state"], "step": s["step"],
                          "total_steps": s["total_steps"], "percent": s["percent"], "eta_seconds": s["eta_seconds"],
                          "started": s["started"], "world_size": s["world_size"],
                          "loss": losses[0] if losses else (s["results"] or {}).get("final_loss")})
        with self.lock:  # runs deleted since: their readers go
            for gone in set(self.watchers) - set(folders):
                del self.watchers[gone]
        return found


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def build_app(root: Path, token: str, stop_grace: float = 120.0, names: ServedNames | None = None) -> Starlette:
    """The page's app; ``names``: the host names it is served under (default: this machine's loopback only)."""
    state = WebState(root, stop_grace)

    def not_found() -> JSONResponse:
        return JSONResponse({"error": "no such run under this page's root"}, status_code=404)

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def runs(request: Request) -> JSONResponse:
        return JSONResponse({"root": str(state.root), "runs": await run_in_threadpool(state.listing)})

    async def run(request: Request) -> JSONResponse:
        folder = state.run_folder(request.query_params.get("id"))
        if folder is None:
            return not_found()
        return JSONResponse(await run_in_threadpool(state.detail, folder))

    async def run_curves(request: Request) -> JSONResponse:
        folder = state.run_folder(request.query_params.get("id"))
        if folder is None:
            return not_found()
        return JSONResponse({"id": state.run_id(folder), "name": folder.name,
                             "curves": await run_in_threadpool(state.watcher(folder).curves)})

    async def run_config(request: Request) -> JSONResponse:
        folder = state.run_folder(request.query_params.get("id"))
        if folder is None:
            return not_found()
        config = await run_in_threadpool(config_of, folder)
        other_id = request.query_params.get("other")
        diff = None
        if other_id:
            other = state.run_folder(other_id)
            if other is None:
                return not_found()
            diff = config_diff(config or {}, config_of(other) or {})
        return JSONResponse({"config": config, "diff": diff})

    async def events(request: Request) -> Response:
        folder = state.run_folder(request.query_params.get("id"))
        if folder is None:
            return not_found()

        async def stream():
            last = None
            while not await request.is_disconnected():
                detail = await run_in_threadpool(state.detail, folder)
                text = json.dumps(detail, default=str)
                if text != last:
                    yield f"data: {text}\n\n"
                    last = text
                else:
                    yield ": keep-alive\n\n"
                await asyncio.sleep(EVENT_INTERVAL)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def schema(request: Request) -> JSONResponse:
        return JSONResponse({"fields": await run_in_threadpool(form_fields)})

    async def check(request: Request) -> JSONResponse:
        launch = await read_request(request)
        if isinstance(launch, JSONResponse):
            return launch
        result = await run_in_threadpool(check_request, launch, state.root, _scratch(state.root))
        return JSONResponse({"ok": not result.problems, "problems": result.problems, "verdict": result.verdict})

    async def launch(request: Request) -> JSONResponse:
        launch_request = await read_request(request)
        if isinstance(launch_request, JSONResponse):
            return launch_request
        result = await run_in_threadpool(check_request, launch_request, state.root, _scratch(state.root))
        out = result.output_dir
        if result.problems or out is None:
            return JSONResponse({"ok": False, "problems": result.problems}, status_code=400)
        if out.is_dir() and is_run_folder(out) and state.watcher(out).summary()["state"] in ("running", "starting",
                                                                                            "stalled"):
            return problem(409, "output_dir", f"output_dir ({out}): a run is still going on there; stop it first")
        try:
            folder = await run_in_threadpool(launch_detached, launch_request, state.root, out)
        except OSError as err:
            return problem(400, "output_dir", f"output_dir ({out}): cannot start the run there: {err.strerror}")
        return JSONResponse({"ok": True, "id": state.run_id(folder), "verdict": result.verdict})

    async def stop(request: Request) -> JSONResponse:
        folder = state.run_folder(request.query_params.get("id"))
        if folder is None:
            return not_found()
        threading.Thread(target=stop_run, args=(folder, state.stop_grace), daemon=True).start()
        return JSONResponse({"ok": True, "requested": time.time()}, status_code=202)

    routes = [
        Route("/", index), Route("/api/runs", runs), Route("/api/run", run), Route("/api/curves", run_curves),
        Route("/api/config", run_config), Route("/api/events", events), Route("/api/schema", schema),
        Route("/api/check", check, methods=["POST"]), Route("/api/launch", launch, methods=["POST"]),
        Route("/api/stop", stop, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    guard = Middleware(RequestGuard, token=token, names=names or served_names("127.0.0.1"))
    return Starlette(routes=routes, middleware=[guard])


def _scratch(root: Path) -> Path:
    return root / ".shardtune-web"


def problem(status: int, key: str | None, line: str) -> JSONResponse:
    """A refused request, as the form shows it: its one line at the key it names."""
    return JSONResponse({"ok": False, "error": line, "problems": [{"key": key, "problem": line}]}, status_code=status)


async def read_request(request: Request) -> LaunchRequest | JSONResponse:
    """The form's request, or the one line that refuses a body the page never sends."""
    try:
        return parse_launch_request(await request.json())
    except ValueError as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors too
        line = str(err) if not isinstance(err, (json.JSONDecodeError, UnicodeDecodeError)) else \
            "the request body is not JSON"
        return problem(400, None, line)
