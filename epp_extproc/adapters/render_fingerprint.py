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
`max_bytes` are refused, and entries live only as long as their endpoint. The reads come due one worker at a
time (each read completes at its own moment, and a failure's retry is jittered), so the watcher wakes often:
a wake-up costs what is due, never a pass over the pool (the due times are kept in a heap; a removed worker's
connection is dropped by name). Scanning every entry per wake-up cost a 10,000-worker picker about 40% of a
core with nothing else to do (`bench/README.md`, "The picker's background at 10,000 workers").
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
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
        # (due, tie-break, address, entry) per scheduled read; an item whose entry was replaced or rescheduled
        # since is stale and skipped when it surfaces (lazy deletion: rescheduling is a push, never a search)
        self._queue: list[tuple[float, int, str, _Entry]] = []
        self._pushes = itertools.count()
        self._gone: set[str] = set()  # removed workers whose kept-alive connection is still to drop
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
            if ep.address not in self.registry and self._entries.pop(ep.address, None) is not None:
                self._gone.add(ep.address)
        for ep in added:
            self._gone.discard(ep.address)
            self._put(ep.address, _Entry())  # (re)admitted: read at once, trust nothing before
        if added or self._gone:
            self._wake.set()

    def lost(self, address: str) -> None:
        """The worker's process is gone (connection refused): forget its fingerprint and re-read soon."""
        if address in self._entries:
            self._put(address, _Entry(due=time.monotonic() + self.retry_s))
            self._wake.set()

    def _put(self, address: str, entry: _Entry) -> None:
        self._entries[address] = entry
        self._schedule(address, entry)

    def _schedule(self, address: str, entry: _Entry) -> None:
        """Queue `entry`'s read at its `due` (call after every change of it)."""
        q = self._queue
        if len(q) > 2 * len(self._entries) + 1024:  # mostly stale items (churn): rebuild, amortised O(1)
            q[:] = [(e.due, next(self._pushes), a, e) for a, e in self._entries.items() if e is not entry]
            heapq.heapify(q)
        heapq.heappush(q, (entry.due, next(self._pushes), address, entry))

    def _live(self, item: tuple[float, int, str, _Entry]) -> bool:
        due, _, address, entry = item
        return self._entries.get(address) is entry and entry.due == due

    def _pop_due(self, now: float) -> list[str]:
        """The workers whose read is due by `now`, each once; their queue items are consumed."""
        q, due = self._queue, {}
        while q and q[0][0] <= now:
            item = heapq.heappop(q)
            if self._live(item):
                due[item[2]] = None
        return list(due)

    def _next_due(self) -> float | None:
        q = self._queue
        while q and not self._live(q[0]):
            heapq.heappop(q)
        return q[0][0] if q else None

    # ------------------------------------------------------------- reading
    async def run(self) -> None:
        try:
            while True:
                while self._gone:  # (also those removed while a read of theirs was in flight)
                    address = self._gone.pop()
                    if address not in self._entries:
                        await self._http.forget(address)
                now = time.monotonic()
                due = self._pop_due(now)
                if due:
                    await asyncio.gather(*(self._read(a) for a in due))
                    continue
                nxt = self._next_due()
                if nxt is None:
                    nxt = now + self.refresh_s
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
            self._schedule(address, entry)
            return
        if fp != entry.fingerprint or entry.state == "unknown":
            log.info("render fingerprint of %s: %s", address,
                     f"{fp.digest[:12]}{'' if fp.complete else ' (incomplete)'}" if fp else "none")
        entry.fingerprint, entry.state, entry.due = fp, "known" if fp else "missing", now + self.refresh_s
        entry.failures = 0
        self._schedule(address, entry)

    async def _fetch(self, address: str) -> tuple[FingerprintId | None, str]:
        """(fingerprint, outcome): outcome ok | missing (answered without one) | error (no usable answer)."""
        outcome, doc = await read_server_info(self._http, address, max_bytes=self.max_bytes)
        if outcome != "ok":
            return None, outcome
        fp = fingerprint_id(doc.get("render_fingerprint")) if isinstance(doc, dict) else None
        return fp, "ok" if fp else "missing"
