"""Active health probing of the discovered endpoints, so a dead worker stops receiving requests.

Discovery (a static list, a file, even Kubernetes between a crash and the pod turning NotReady) can name a
worker that no longer answers. Because a dead worker finishes "its" requests instantly (Envoy answers 503),
it looks idle, and least-loaded or prefix-affine picking would send it MORE traffic. The prober GETs each
endpoint's health path every interval: a refused connection takes the endpoint out of rotation at once (no
process listens there, so its KV cache is gone too: `on_lost` lets the KV index drop it and resync), other
failures (timeouts, 5xx) after two probes in a row; one successful probe puts it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from epp_extproc.core.endpoints import EndpointRegistry

log = logging.getLogger(__name__)

FAILURES_TO_DOWN = 2


class EndpointProber:
    def __init__(self, registry: EndpointRegistry, *, interval_s: float, path: str = "/health",
                 timeout_s: float | None = None, on_lost: Callable[[str], None] | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else max(0.2, min(2.0, 2 * interval_s))
        self.path = path if path.startswith("/") else "/" + path
        self.on_lost = on_lost
        self.on_change = on_change
        self._failures: dict[str, int] = {}
        self._lost: set[str] = set()  # refused since its last good probe: on_lost already called
        self._session: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        # a fresh connection per probe: a pooled keep-alive socket would hide a dead process behind a reset
        conn = aiohttp.TCPConnector(force_close=True, limit=64)
        self._session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(
            total=self.timeout_s))
        try:
            while True:
                await self.probe_all()
                await asyncio.sleep(self.interval_s)
        finally:
            with contextlib.suppress(Exception):
                await self._session.close()

    async def probe_all(self) -> None:
        eps = self.registry.all()
        results = await asyncio.gather(*(self._probe(ep.address) for ep in eps))
        self._failures = {a: n for a, n in self._failures.items() if a in self.registry}
        self._lost &= {a for a in self._lost if a in self.registry}
        for ep, (ok, refused, why) in zip(eps, results, strict=True):
            self._verdict(ep.address, ok, refused, why)

    async def _probe(self, address: str) -> tuple[bool, bool, str]:
        """(healthy, connection refused, reason)."""
        assert self._session is not None
        try:
            async with self._session.get(f"http://{address}{self.path}") as r:
                await r.read()
                return 200 <= r.status < 300, False, f"HTTP {r.status}"
        except aiohttp.ClientConnectorError as e:
            refused = isinstance(e.os_error, ConnectionRefusedError)
            return False, refused, "connection refused" if refused else f"cannot connect: {e.os_error}"
        except TimeoutError:
            return False, False, f"no answer within {self.timeout_s}s"
        except aiohttp.ClientError as e:
            return False, False, f"{type(e).__name__}: {e}"

    def _verdict(self, address: str, ok: bool, refused: bool, why: str) -> None:
        if address not in self.registry:
            return  # removed while being probed
        if ok:
            self._failures.pop(address, None)
            self._lost.discard(address)
            if self.registry.set_healthy(address, True):
                log.warning("endpoint %s is back in rotation", address)
                self._changed()
            return
        n = self._failures[address] = self._failures.get(address, 0) + 1
        if refused or n >= FAILURES_TO_DOWN:
            if self.registry.set_healthy(address, False):
                log.warning("endpoint %s taken out of rotation: %s", address, why)
                self._changed()
        if refused and address not in self._lost:
            self._lost.add(address)
            if self.on_lost is not None:
                self.on_lost(address)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
