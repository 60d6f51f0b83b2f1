"""`shardtune web [ROOT] [--port P] [--host H] [--token-file FILE]`: serve the live page of the runs under ROOT."""

from __future__ import annotations

import argparse
import importlib.util
import re
import secrets
import socket
from pathlib import Path

from shardtune.arguments import CommandParser, positive_seconds, whole_number
from shardtune.errors import ConfigError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
_TOKEN = re.compile(r"[A-Za-z0-9._~-]{8,}")


def web_command(args: list[str]) -> int:
    parser = CommandParser(prog="shardtune web",
                                     description="A live page of the runs under ROOT: progress, curves, every "
                                                 "rank, errors, checkpoints; launch and stop runs from it.")
    parser.add_argument("root", nargs="?", default=".", help="folder whose runs the page shows (default: here)")
    parser.add_argument("--port", type=whole_number(0, 65535), default=7860,
                        help="port (default 7860; 0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; see the ssh -L line printed)")
    parser.add_argument("--token-file", metavar="FILE",
                        help="a file whose first line is the token every request needs (default: a new random one)")
    parser.add_argument("--token", help=argparse.SUPPRESS)  # refused below, with the reason
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="a further host name the page is reached by (a reverse proxy's); repeatable")
    parser.add_argument("--stop-grace", type=positive_seconds, default=120.0, metavar="SECONDS",
                        help="how long Stop waits for the ranks to save and exit before it kills them")
    ns = parser.parse_args(args)
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"shardtune web needs {' and '.join(missing)}: pip install 'shardtune[web]'")
    root = Path(ns.root).resolve()
    if not root.is_dir():
        raise ConfigError(f"web: ROOT ({ns.root}) is not a folder")
    token = read_token(ns.token, ns.token_file)
    import uvicorn

    from shardtune.web.guard import served_names
    from shardtune.web.server import build_app

    sock = bind_socket(ns.host, ns.port)
    port = sock.getsockname()[1]
    print(serving_lines(root, ns.host, port, token), flush=True)
    app = build_app(root, token, ns.stop_grace, served_names(ns.host, ns.allow_host))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def read_token(given: str | None, token_file: str | None) -> str:
    """The token from ``--token-file`` (a new random one without it). A token on the command line is refused:
    every user of the machine reads command lines (ps, /proc/PID/cmdline)."""
    if given is not None:
        raise ConfigError("web: --token would show the token to every user of this machine (ps lists command "
                          "lines); write it to a file only you can read and pass --token-file FILE")
    if token_file is None:
        return secrets.token_urlsafe(18)
    try:
        lines = Path(token_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"web: --token-file ({token_file}): cannot read it ({err})") from None
    token = lines[0].strip() if lines else ""
    if not _TOKEN.fullmatch(token):  # it goes into the printed URL as it is
        raise ConfigError(f"web: --token-file ({token_file}): its first line must be the token: 8 or more of "
                          "A-Z a-z 0-9 . _ ~ -")
    return token


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
        lines.append(f"shardtune: warning: listening on {host}: anyone who can reach this port can try; every "
                     "request needs the token, sent in the clear (plain HTTP): prefer 127.0.0.1 and ssh -L")
    lines.append("[shardtune] Ctrl-C stops the page; runs started from it go on")
    return "\n".join(lines)


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "you"
