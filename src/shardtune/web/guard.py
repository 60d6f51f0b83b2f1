"""Who may ask the page anything: every request's Host, and for the API its Origin and the token.

A page on another site can make the browser of someone running `shardtune web` send requests to 127.0.0.1: by its
own name rebound to 127.0.0.1 (DNS rebinding, where the browser then lets it read the answers), or cross-origin
(where it cannot read them but the request still acts). So the Host must be a name this server is served under, an
API request from a browser must come from the page itself (its Origin, or Sec-Fetch-Site), and every API request,
read or action, must carry the token `shardtune web` printed. The page and its static files need only the Host: they
hold no data, and a link to the printed URL from anywhere must open.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

TOKEN_HEADER = "x-shardtune-token"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::", ""})
_SAME_PAGE = frozenset({"same-origin", "none"})  # Sec-Fetch-Site of the page's own requests, or a typed URL


@dataclass(frozen=True)
class ServedNames:
    """The host names a request may carry: this server's address, and the names it is reached by.

    The port is not compared: an ``ssh -L 8000:127.0.0.1:7860`` tunnel brings the page's requests with Host
    ``127.0.0.1:8000``, and a rebinding attack is told apart by its name, never by its port."""

    names: frozenset[str]
    any_address: bool = False  # bound to every interface: any IP literal of this machine, which no site can rebind

    def allow(self, host_header: str) -> bool:
        name = host_name(host_header)
        if name is None:
            return False
        return name in self.names or (self.any_address and _is_ip(name))


def served_names(bind_host: str, extra: Iterable[str] = ()) -> ServedNames:
    """The names a server bound to ``bind_host`` is reached by (``extra``: ``--allow-host``, e.g. a proxy's name)."""
    names = set(LOOPBACK_NAMES) | {n.lower().rstrip(".") for n in extra}
    wildcard = bind_host in WILDCARD_ADDRESSES
    if bind_host not in LOOPBACK_NAMES:  # reachable from other machines: by its address and this machine's names
        names |= {bind_host.lower(), socket.gethostname().lower(), socket.getfqdn().lower()} - WILDCARD_ADDRESSES
    return ServedNames(frozenset(names), any_address=wildcard)


def host_name(host_header: str) -> str | None:
    """The name of a Host header (``name:port``, ``[v6]:port``), lowercase; None when it is not one."""
    text = host_header.strip().lower()
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        return inside if bracket and (not rest or rest[1:].isdigit() and rest[0] == ":") and _is_ip(inside) else None
    name, _, port = text.partition(":")
    if port and not port.isdigit() or not name:
        return None
    return name.rstrip(".")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def refusal(method: str, path: str, headers: dict[str, str], query: str, token: str,
            names: ServedNames) -> tuple[int, str] | None:
    """Why a request is refused (its status and one line), or None when it may go on."""
    host = headers.get("host", "")
    if not names.allow(host):
        return 421, (f"this page is not served under the name {host!r}; open the URL `shardtune web` printed (a "
                     "proxy's name needs --allow-host)")
    if not path.startswith("/api/"):
        return None
    origin = headers.get("origin")
    if origin is not None and not _same_origin(origin, host):
        return 403, f"a request from another site ({origin}) is refused: use the page itself"
    if headers.get("sec-fetch-site", "same-origin") not in _SAME_PAGE:
        return 403, "a request from another site is refused: use the page itself"
    given = headers.get(TOKEN_HEADER)
    if given is None and method in ("GET", "HEAD"):  # an EventSource cannot send a header: its URL carries it
        given = (parse_qs(query).get("token") or [""])[0]
    if not secrets.compare_digest((given or "").encode("utf-8", "surrogateescape"), token.encode("utf-8")):
        return 403, ("this page needs its token: open the URL `shardtune web` printed (it ends with ?token=...)")
    return None


def _same_origin(origin: str, host: str) -> bool:
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower()


class RequestGuard:
    """ASGI middleware answering a refused request with its one line (JSON ``{"error": ...}``)."""

    def __init__(self, app: ASGIApp, token: str, names: ServedNames) -> None:
        self.app, self.token, self.names = app, token, names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refused = refusal(scope.get("method", "GET"), scope["path"], headers,
                              scope.get("query_string", b"").decode("latin-1"), self.token, self.names)
            if refused is not None:
                if scope["type"] == "websocket":  # the page uses none; close it unaccepted
                    await send({"type": "websocket.close", "code": 1008})
                    return
                status, line = refused
                await JSONResponse({"error": line}, status_code=status,
                                   headers={"Cache-Control": "no-store"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
