"""The one way the picker reaches a worker over HTTP outside the render path: health probes, /metrics
scrapes, /server_info and /v1/models reads all go through `WorkerHttp`.

One client (`adapters/http1.py`, the llhttp-based client the render calls already use) instead of an aiohttp
session per module: one policy for timeouts and body caps, one error vocabulary (`HttpError` and its
subclasses, a timeout included), and kept-alive connections per worker shared by every reader. http1 won the
same-run measurement against aiohttp for this pattern (a small GET to a loopback worker: CPU per request,
see the branch report / `bench/README.md`).

Bounded: at most `per_worker` requests in flight to one worker (a hung worker holds that many sockets, not
one per caller), every answer capped at the caller's `max_body`, every call bounded by a timeout, and the
origins of workers no longer known are dropped (`retain`, `forget`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

from epp_extproc.adapters.http1 import BodyTooLarge, ConnectFailed, HttpError, Origin, Response

__all__ = ["BodyTooLarge", "ConnectFailed", "HttpError", "Response", "TimedOut", "WorkerHttp"]

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # a worker's /metrics is a few hundred kB; never buffer an endless answer
PER_WORKER = 4


class TimedOut(HttpError):
    """No complete answer within the call's timeout."""


class WorkerHttp:
    """GETs to workers addressed as `host:port`; kept-alive connections per worker unless `fresh`."""

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, max_body: int = DEFAULT_MAX_BODY,
                 per_worker: int = PER_WORKER) -> None:
        self.timeout_s = timeout_s
        self.max_body = max_body
        self.per_worker = per_worker
        self._origins: dict[str, Origin] = {}

    async def get(self, address: str, path: str, *, timeout_s: float | None = None,
                  max_body: int | None = None, fresh: bool = False) -> Response:
        """One GET. Raises `HttpError`: `ConnectFailed` (`.refused` when nothing listens), `TimedOut`,
        `BodyTooLarge`, `BadResponse`; never another error for anything the worker sends.

        `fresh`: a new connection, closed after the answer (a health probe: a kept-alive socket would hide
        a dead process behind a reset).
        """
        if fresh:
            origin = self._origin_for(address, keep=False)
        else:
            origin = self._origins.get(address) or self._origin_for(address, keep=True)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await origin.get(path, max_body=self.max_body if max_body is None else max_body)
        except TimeoutError:
            raise TimedOut(f"no answer within {timeout}s") from None
        finally:
            if fresh:
                await origin.close()

    def _origin_for(self, address: str, *, keep: bool) -> Origin:
        try:
            origin = Origin(f"http://{address}", limit=self.per_worker)
        except ValueError as e:
            raise ConnectFailed(str(e)) from None
        if keep:
            self._origins[address] = origin
        return origin

    async def forget(self, address: str) -> None:
        origin = self._origins.pop(address, None)
        if origin is not None:
            with contextlib.suppress(Exception):
                await origin.close()

    async def retain(self, addresses: Iterable[str]) -> None:
        """Drop the connections of every worker not in `addresses` (removed from the pool)."""
        keep = set(addresses)
        for gone in [a for a in self._origins if a not in keep]:
            await self.forget(gone)

    async def close(self) -> None:
        for address in list(self._origins):
            await self.forget(address)
