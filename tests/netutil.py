"""Small helpers shared by the integration tests: free loopback ports and waiting for listeners (the shared
`epp_extproc.dev.procs` ones, plus a base port with free offsets)."""

from __future__ import annotations

import socket

from epp_extproc.dev.procs import free_port, wait_port

__all__ = ["free_base_port", "free_port", "wait_port"]


def free_base_port(offsets: tuple[int, ...], attempts: int = 50) -> int:
    """A base port such that base + every offset is free right now (for tools that derive ports from a base)."""
    for _ in range(attempts):
        base = free_port()
        if base + max(offsets) >= 65535:
            continue
        socks = []
        try:
            for off in offsets:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no base port with offsets {offsets} free")
