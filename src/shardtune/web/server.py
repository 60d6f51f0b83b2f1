"""The page's HTTP side (Starlette): read-only JSON about the runs under ROOT, a server-sent event stream per run,
and two actions that need the token (launch, stop). Only run folders under ROOT are read; the only files served
as they are come from this package's static/ folder."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from shardtune import run_files
from shardtune.web.form import form_fields
from shardtune.web.processes import LaunchRequest, check_request, launch_detached, stop_run
from shardtune.web.rank_table import read_rank_logs
from shardtune.web.runs import (
    RunWatcher,
    config_diff,
    config_of,
    curves,
    find_runs,
    is_run_folder,
    node_commands,
    read_json,
    run_summary,
)

STATIC = Path(__file__).parent / "static"
EVENT_INTERVAL = 0.5  # seconds between looks at a watched run's files
TOKEN_HEADER = "x-shardtune-token"


class WebState:
    """ROOT, the token, and the watchers of the runs the page looks at (so each look reads only new lines)."""

    def __init__(self, root: Path, token: str, stop_grace: float) -> None:
        self.root = root.resolve()
        self.token = token
        self.stop_grace = stop_grace
        self.watchers: dict[Path, RunWatcher] = {}
        self.lock = threading.Lock()

    def run_folder(self, relative: str | None) -> Path | None:
        """The run folder ``relative`` names under ROOT, or None (outside ROOT, missing, or not a run)."""
        if relative is None:
            return None
        folder = (self.root / relative).resolve()
        if not folder.is_relative_to(self.root) or not folder.is_dir() or not is_run_folder(folder):
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
        stop = read_json(folder / run_files.STOP_REPORT)
        summary["stop"] = stop if stop and summary["started"] and stop.get("requested", 0) >= summary["started"] \
            else None
        return summary

    def authorised(self, request: Request) -> bool:
        return secrets.compare_digest(request.headers.get(TOKEN_HEADER, ""), self.token)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def build_app(root: Path, token: str, stop_grace: float = 120.0) -> Starlette:
    state = WebState(root, token, stop_grace)

    def not_found() -> JSONResponse:
        return JSONResponse({"error": "no such run under this page's root"}, status_code=404)

    def forbidden() -> JSONResponse:
        return JSONResponse({"error": "this action needs the page's token: open the URL `shardtune web` printed "
                                      "(it ends with ?token=...)"}, status_code=403)

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def runs(request: Request) -> JSONResponse:
        def listing() -> list[dict[str, Any]]:
            found = []
            for folder in find_runs(state.root):
                s = run_summary(folder, read_rank_logs(folder / "ranks"))
                losses = [r["loss"] for r in s["ranks"] if r["loss"] is not None]
                found.append({"id": state.run_id(folder), "name": s["name"], "state": s["state"], "step": s["step"],
                              "total_steps": s["total_steps"], "percent": s["percent"], "eta_seconds": s["eta_seconds"],
                              "started": s["started"], "world_size": s["world_size"],
                              "loss": losses[0] if losses else (s["results"] or {}).get("final_loss")})
            return found
        return JSONResponse({"root": str(state.root), "runs": await run_in_threadpool(listing)})

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
                             "curves": await run_in_threadpool(curves, folder)})

    async def run_config(request: Request) -> JSONResponse:
        folder = state.run_folder(request.query_params.get("id"))
        if folder is None:
            return not_found()
        config = config_of(folder)
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

    async def read_request(request: Request) -> LaunchRequest:
        body = await request.json()
        values = {str(k): str(v) for k, v in (body.get("values") or {}).items()}
        return LaunchRequest(str(body.get("yaml") or ""), values, int(body.get("nproc_per_node") or 1))

    async def check(request: Request) -> JSONResponse:
        if not state.authorised(request):
            return forbidden()
        launch = await read_request(request)
        problems, verdict = await run_in_threadpool(check_request, launch, state.root, _scratch(state.root))
        return JSONResponse({"ok": not problems, "problems": problems, "verdict": verdict})

    async def launch(request: Request) -> JSONResponse:
        if not state.authorised(request):
            return forbidden()
        launch_request = await read_request(request)
        problems, verdict = await run_in_threadpool(check_request, launch_request, state.root, _scratch(state.root))
        if problems:
            return JSONResponse({"ok": False, "problems": problems}, status_code=400)
        out = launch_request.output_dir(state.root)
        assert out is not None
        if out.is_dir() and is_run_folder(out) and state.watcher(out).summary()["state"] in ("running", "starting",
                                                                                            "stalled"):
            return JSONResponse({"ok": False, "problems": [{"key": "output_dir", "problem": f"output_dir ({out}): "
                                                            "a run is still going on there; stop it first"}]},
                                status_code=409)
        folder = await run_in_threadpool(launch_detached, launch_request, state.root)
        return JSONResponse({"ok": True, "id": state.run_id(folder), "verdict": verdict})

    async def stop(request: Request) -> JSONResponse:
        if not state.authorised(request):
            return forbidden()
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
    return Starlette(routes=routes)


def _scratch(root: Path) -> Path:
    return root / ".shardtune-web"
