"""Who may use `/debug`: the admin port has no authentication, so its safety is where it listens and whom it
answers.

It listens on loopback by default (`--admin-bind 127.0.0.1`), which keeps other hosts out but not a browser on
the operator's own machine: a web page can send requests to `http://127.0.0.1:9091` (cross-site requests), and
with DNS rebinding (a name of the attacker's that first resolves to its server, then to 127.0.0.1) it can even
read the answers, because the browser then takes the admin port for the attacker's own origin. Both are
refused here, for every `/debug` path (the page, the JSON it reads and `/debug/score`), before any handler
runs:

- Host: a loopback name or address (`localhost`, 127.0.0.0/8, `::1`), the configured `--admin-bind` address,
  or the address literal the connection arrived on (an operator who binds a pod IP and types it). A DNS name
  is what rebinding needs, and is refused: reach the port through `kubectl port-forward` or `ssh -L`.
- Origin, when a browser sends one: the same origin as the Host (scheme http or https, same host and port).
- Sec-Fetch-Site, when a browser sends it: only `same-origin` or `none` (the operator typed the address).

Refusals are 403 with a reason; `/metrics` is not guarded (Prometheus scrapes it by pod IP, and it is served on
all interfaces anyway).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import urlsplit

from aiohttp import web

GUARDED_PREFIX = "/debug"
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})
FETCH_SITES_ALLOWED = frozenset({"same-origin", "none"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def hostname_of(host: str) -> str | None:
    """The name or address of a Host header value (`name`, `name:port`, `[v6]:port`), lowercased; None when
    it is not one."""
    host = host.strip().lower()
    if not host:
        return None
    if host.startswith("["):
        end = host.find("]")
        if end < 0 or (host[end + 1:] and not host[end + 1:].startswith(":")):
            return None
        return host[1:end]
    name, sep, port = host.rpartition(":")
    if sep and ":" not in name:  # `name:port` (more colons without brackets: a bare IPv6 literal)
        return name if port.isdigit() else None
    return host


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return None


def host_allowed(name: str, bind: str, local: str | None) -> bool:
    """May a request naming `name` as its host be answered on a listener bound to `bind`, reached at `local`?"""
    if name in LOOPBACK_NAMES:
        return True
    ip = _ip(name)
    if ip is None:  # a DNS name: what a rebinding attack needs
        return name == bind.lower()  # an operator's own name for the bind address (rebinding needs one of the attacker's)
    if ip.is_loopback:
        return True
    b = _ip(bind)
    if b is not None and not b.is_unspecified and ip == b:
        return True
    loc = _ip(local) if local else None
    return loc is not None and ip == loc


def refusal(headers: Mapping[str, str], bind: str, local: str | None) -> str | None:
    """Why a `/debug` request is refused (None: it may be answered)."""
    host = headers.get("Host")
    if host is None:
        return "no Host header"
    name = hostname_of(host)
    if name is None or not host_allowed(name, bind, local):
        return "Host is not a loopback or admin-bind address (use a port-forward to 127.0.0.1)"
    origin = headers.get("Origin")
    if origin is not None:
        u = urlsplit(origin)
        if u.scheme not in ("http", "https") or u.netloc.lower() != host.strip().lower():
            return "cross-origin request"
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site not in FETCH_SITES_ALLOWED:
        return "cross-site request"
    return None


def guard(bind: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """aiohttp middleware refusing `/debug` requests whose Host, Origin or Sec-Fetch-Site says another site."""

    @web.middleware
    async def middleware(req: web.Request, handler: Handler) -> web.StreamResponse:
        if not req.path.startswith(GUARDED_PREFIX):
            return await handler(req)
        sock = req.transport.get_extra_info("sockname") if req.transport is not None else None
        local = str(sock[0]) if isinstance(sock, tuple) and sock else None
        why = refusal(req.headers, bind, local)
        if why is not None:
            return web.Response(status=403, text=f"403 Forbidden: {why}\n",
                                headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})
        return await handler(req)

    return middleware
