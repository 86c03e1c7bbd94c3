"""Which render fingerprint each worker has: read from its `GET /server_info`, kept current.

Prompt passthrough may only hand a worker ids rendered under its own rendering configuration (chat template,
tokenizer, model type). A worker says which one it has in `/server_info` `render_fingerprint`. This watcher
reads it (through `server_info.read_server_info`, the one reader of that document) once per worker at
admission (the registry's `added`), again as soon as the prober reports the
worker's process gone (`lost`: a restarted worker may have been redeployed with another template), and
every `refresh_s` otherwise, so a restart the prober missed is picked up within that bound. Until a read
succeeds the fingerprint is unknown, and an unknown fingerprint never matches: the picker forwards the
original body, which is always correct. A read that fails (timeout, 5xx) keeps what was read before: a
saturated worker answering `/server_info` late has not changed its template, and dropping its fingerprint
would make the picker send it MORE work (the original body) exactly when it is busiest.

Bounded: one small GET per worker per refresh (a failed read retries after `retry_s`, backing off by the
house's schedule, `kvindex.backoff`, up to `refresh_s`), answers over
`max_bytes` are refused, and entries live only as long as their endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from epp_extproc.adapters.server_info import MAX_SERVER_INFO_BYTES, read_server_info
from epp_extproc.adapters.worker_http import WorkerHttp
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.passthrough import FingerprintId, fingerprint_id
from epp_extproc.metrics import PickerMetrics
from kvindex.backoff import backoff_delay

log = logging.getLogger(__name__)

__all__ = ["MAX_SERVER_INFO_BYTES", "FingerprintWatcher"]


@dataclass(slots=True)
class _Entry:
    fingerprint: FingerprintId | None = None
    state: str = "unknown"  # unknown (never read, or lost) | missing (read: no usable fingerprint) | known
    due: float = 0.0  # monotonic time of the next read
    failures: int = 0  # failed reads in a row (each backs the retry off further, up to refresh_s)


class FingerprintWatcher:
    def __init__(self, registry: EndpointRegistry, metrics: PickerMetrics, *, refresh_s: float,
                 retry_s: float = 0.5, timeout_s: float = 2.0, max_bytes: int = MAX_SERVER_INFO_BYTES,
                 http: WorkerHttp | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.refresh_s = refresh_s
        self.retry_s = min(retry_s, refresh_s)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._http = http or WorkerHttp(timeout_s=timeout_s, max_body=max_bytes)
        self._entries: dict[str, _Entry] = {}
        self._wake = asyncio.Event()
        registry.subscribe(self._on_endpoints)

    # ------------------------------------------------------------- queries
    def get(self, address: str) -> FingerprintId | None:
        """The worker's fingerprint as last read; None while unknown or when it has none."""
        e = self._entries.get(address)
        return e.fingerprint if e is not None else None

    def state(self, address: str) -> str:
        e = self._entries.get(address)
        return e.state if e is not None else "unknown"

    # ------------------------------------------------------------- events
    def _on_endpoints(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for ep in removed:
            if ep.address not in self.registry:
                self._entries.pop(ep.address, None)
        for ep in added:
            self._entries[ep.address] = _Entry()  # (re)admitted: read at once, trust nothing before
        if added:
            self._wake.set()

    def lost(self, address: str) -> None:
        """The worker's process is gone (connection refused): forget its fingerprint and re-read soon."""
        if address in self._entries:
            self._entries[address] = _Entry(due=time.monotonic() + self.retry_s)
            self._wake.set()

    # ------------------------------------------------------------- reading
    async def run(self) -> None:
        try:
            while True:
                now = time.monotonic()
                due = [a for a, e in self._entries.items() if e.due <= now]
                if due:
                    await asyncio.gather(*(self._read(a) for a in due))
                    await self._http.retain(self._entries)
                    continue
                nxt = min((e.due for e in self._entries.values()), default=now + self.refresh_s)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.01, nxt - now)):
                        await self._wake.wait()
        finally:
            await self._http.close()

    async def _read(self, address: str) -> None:
        fp, outcome = await self._fetch(address)
        entry = self._entries.get(address)
        if entry is None:
            return  # removed while being read
        self.metrics.fingerprint_reads.labels(outcome).inc()
        now = time.monotonic()
        if outcome == "error":
            # A busy worker that misses one read has not changed its configuration: keep what was read (a
            # restart shows as a refused connection, `lost`) and try again soon, backing off.
            entry.due = now + backoff_delay(entry.failures, self.retry_s, self.refresh_s)
            entry.failures += 1
            return
        if fp != entry.fingerprint or entry.state == "unknown":
            log.info("render fingerprint of %s: %s", address,
                     f"{fp.digest[:12]}{'' if fp.complete else ' (incomplete)'}" if fp else "none")
        entry.fingerprint, entry.state, entry.due = fp, "known" if fp else "missing", now + self.refresh_s
        entry.failures = 0

    async def _fetch(self, address: str) -> tuple[FingerprintId | None, str]:
        """(fingerprint, outcome): outcome ok | missing (answered without one) | error (no usable answer)."""
        outcome, doc = await read_server_info(self._http, address, max_bytes=self.max_bytes)
        if outcome != "ok":
            return None, outcome
        fp = fingerprint_id(doc.get("render_fingerprint")) if isinstance(doc, dict) else None
        return fp, "ok" if fp else "missing"
