"""Which prefill worker a request names, and whether the sidecar may reach it.

The header is the picker's (or llm-d's router's): ``x-prefiller-host-port``. llm-d's sidecar
(llm-d/llm-d-inference-scheduler ``pkg/sidecar/proxy/chat_completions.go``, commit 520af478) takes every copy of
the header; a single copy may be a comma-separated list, of which it uses the first entry. We do the same, and
then demand more than llm-d does: the entry must be one ``ip:port`` literal (no host names: nothing to resolve,
nothing to rebind) of a worker in the allowed list. A target that is not such a literal is a 502; a literal the
sidecar is not allowed to reach is a 403, the status llm-d's SSRF allowlist answers.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

PREFILLER_HEADER = "x-prefiller-host-port"
MAX_HEADER_CHARS = 1024


class TargetRefused(Exception):
    """The header names nothing this sidecar will call; ``status`` and ``reason`` go to the client."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


def canonical(hostport: str) -> str | None:
    """``ip:port`` (``[v6]:port`` for IPv6) normalised, or None when it is not one literal."""
    hostport = hostport.strip()
    if hostport.startswith("["):
        host, sep, port = hostport[1:].partition("]:")
    else:
        host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    p = int(port)
    if not 0 < p < 65536 or (ip.version == 6 and not hostport.startswith("[")):
        return None
    return f"[{ip.compressed}]:{p}" if ip.version == 6 else f"{ip.compressed}:{p}"


def parse_allowed(spec: str | Iterable[str]) -> frozenset[str]:
    """The ``--allowed-prefillers`` list (comma-separated, or already split), every entry canonical."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = set()
    for item in items:
        if not item.strip():
            continue
        c = canonical(item)
        if c is None:
            raise ValueError(f"allowed prefiller {item.strip()!r} is not an ip:port literal")
        out.add(c)
    return frozenset(out)


def prefill_target(values: Sequence[str], allowed: frozenset[str]) -> str | None:
    """The prefill worker to call, None when the request names none (a local request).

    Raises :class:`TargetRefused` for a header that names something the sidecar must not call."""
    if not values:
        return None
    entries = values[0].split(",") if len(values) == 1 else list(values)
    first = entries[0].strip()
    if not first:
        return None  # llm-d: an empty header is no header
    if len(first) > MAX_HEADER_CHARS:
        raise TargetRefused(502, "bad_header", f"{PREFILLER_HEADER} is too long")
    target = canonical(first)
    if target is None:
        raise TargetRefused(502, "bad_header",
                            f"{PREFILLER_HEADER} must be one ip:port literal, got {first[:64]!r}")
    if target not in allowed:
        raise TargetRefused(403, "not_allowed", f"prefill target {target} is not an allowed prefill worker")
    return target
