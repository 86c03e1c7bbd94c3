"""Small helpers shared by the integration tests: free loopback ports and waiting for listeners."""

from __future__ import annotations

import socket
import time

from bench.harness import free_port

__all__ = ["free_base_port", "free_port", "wait_port"]


def wait_port(port: int, host: str = "127.0.0.1", timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


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
