"""`shardtune web [ROOT] [--port P] [--host H]`: serve the live page of the runs under ROOT."""

from __future__ import annotations

import argparse
import importlib.util
import secrets
import socket
from pathlib import Path

from shardtune.errors import ConfigError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def web_command(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardtune web",
                                     description="A live page of the runs under ROOT: progress, curves, every "
                                                 "rank, errors, checkpoints; launch and stop runs from it.")
    parser.add_argument("root", nargs="?", default=".", help="folder whose runs the page shows (default: here)")
    parser.add_argument("--port", type=int, default=7860, help="port (default 7860; 0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; see the ssh -L line printed)")
    parser.add_argument("--token", help="the token that launch and stop need (default: a new random one)")
    parser.add_argument("--stop-grace", type=float, default=120.0, metavar="SECONDS",
                        help="how long Stop waits for the ranks to save and exit before it kills them")
    ns = parser.parse_args(args)
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"shardtune web needs {' and '.join(missing)}: pip install 'shardtune[web]'")
    root = Path(ns.root).resolve()
    if not root.is_dir():
        raise ConfigError(f"web: ROOT ({ns.root}) is not a folder")
    token = ns.token or secrets.token_urlsafe(18)
    import uvicorn

    from shardtune.web.server import build_app

    sock = bind_socket(ns.host, ns.port)
    port = sock.getsockname()[1]
    print(serving_lines(root, ns.host, port, token), flush=True)
    config = uvicorn.Config(build_app(root, token, ns.stop_grace), log_level="warning", timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        raise ConfigError(f"web: cannot listen on {host}:{port} ({err.strerror}); choose another --port") from None
    sock.listen(64)
    return sock


def serving_lines(root: Path, host: str, port: int, token: str) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url_host = f"[{shown}]" if ":" in shown else shown
    lines = [f"[shardtune] runs under {root}", f"[shardtune] open http://{url_host}:{port}/?token={token}"]
    if host in LOCAL_HOSTS:
        lines.append(f"[shardtune] from another machine: ssh -N -L {port}:127.0.0.1:{port} {_user()}@"
                     f"{socket.gethostname()}  then open the same URL there")
    else:
        lines.append(f"shardtune: warning: listening on {host}: anyone who can reach this port sees the runs; "
                     "launch and stop still need the token")
    lines.append("[shardtune] Ctrl-C stops the page; runs started from it go on")
    return "\n".join(lines)


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "you"
