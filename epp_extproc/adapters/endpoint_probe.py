"""Active health probing of the discovered endpoints, so a dead worker stops receiving requests.

Discovery (a static list, a file, even Kubernetes between a crash and the pod turning NotReady) can name a
worker that no longer answers. Because a dead worker finishes "its" requests instantly (Envoy answers 503),
it looks idle, and least-loaded or prefix-affine picking would send it MORE traffic. The prober GETs each
endpoint's health path every interval: a refused connection takes the endpoint out of rotation at once (no
process listens there, so its KV cache is gone too: `on_lost` lets the KV index drop it and resync), other
failures (timeouts, 5xx) after two probes in a row; one successful probe puts it back.

Cost is bounded whatever the pool size: probes are spread evenly (with jitter) over the round instead of
fired all at once, at most `max_rate` probes per second in total (a round lasts max(interval, n / max_rate),
so 1,000 endpoints at the default 100/s are each probed every 10 s), and at most `max_concurrency` are in
flight (a pool of hung workers cannot hold thousands of sockets). Probes go through `WorkerHttp` (the one
way the picker reaches a worker), each on a fresh connection.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from epp_extproc.adapters.worker_http import ConnectFailed, HttpError, TimedOut, WorkerHttp
from epp_extproc.core.endpoints import EndpointRegistry

log = logging.getLogger(__name__)

FAILURES_TO_DOWN = 2
DEFAULT_MAX_RATE = 100.0  # probes per second over the whole pool
DEFAULT_MAX_CONCURRENCY = 32
PROBE_MAX_BODY = 1 << 20  # a health answer is a few bytes; a larger one is read as unhealthy


def round_length(interval_s: float, n: int, max_rate: float) -> float:
    """How long a round over `n` endpoints lasts so that no more than `max_rate` requests per second go out
    over the whole pool: the interval, stretched to n / max_rate for a pool too large for it. The prober and
    the metrics scraper (adapters/worker_metrics.py) both pace their rounds by it, so what a pool costs the
    picker is bounded by the rate, whatever the pool's size."""
    return max(interval_s, n / max_rate)


class EndpointProber:
    def __init__(self, registry: EndpointRegistry, *, interval_s: float, path: str = "/health",
                 timeout_s: float | None = None, on_lost: Callable[[str], None] | None = None,
                 on_change: Callable[[], None] | None = None, max_rate: float = DEFAULT_MAX_RATE,
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY, rng: random.Random | None = None,
                 http: WorkerHttp | None = None) -> None:
        if max_rate <= 0 or max_concurrency <= 0:
            raise ValueError("max_rate and max_concurrency must be positive")
        self.registry = registry
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else max(0.2, min(2.0, 2 * interval_s))
        self.path = path if path.startswith("/") else "/" + path
        self.on_lost = on_lost
        self.on_change = on_change
        self.max_rate = max_rate
        self.max_concurrency = max_concurrency
        self.round_s = interval_s  # how long the current round lasts: interval, or longer for a big pool
        self._rng = rng or random.Random()
        self._failures: dict[str, int] = {}
        self._lost: set[str] = set()  # refused since its last good probe: on_lost already called
        self._http = http or WorkerHttp(timeout_s=self.timeout_s, max_body=PROBE_MAX_BODY)
        self._slots = asyncio.Semaphore(max_concurrency)
        self._inflight: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        try:
            while True:
                await self.probe_round()
        finally:
            for t in list(self._inflight):
                t.cancel()

    async def probe_round(self) -> None:
        """Probe every current endpoint once, spread over max(interval, n / max_rate) seconds.

        Endpoint i (in a random order, so no endpoint is always last) is probed at a random moment within
        its own slot [i, i + 1) * round / n: evenly spread, never in lockstep with other replicas.
        """
        loop = asyncio.get_running_loop()
        eps = self.registry.all()
        self._failures = {a: n for a, n in self._failures.items() if a in self.registry}
        self._lost &= {a for a in self._lost if a in self.registry}
        n = len(eps)
        self.round_s = round_length(self.interval_s, n, self.max_rate)
        started = loop.time()
        self._rng.shuffle(eps)
        slot = self.round_s / n if n else 0.0
        for i, ep in enumerate(eps):
            delay = started + (i + self._rng.random()) * slot - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await self._slots.acquire()  # at most max_concurrency probes in flight; hung ones slow the round
            task = loop.create_task(self._probe_and_judge(ep.address))
            self._inflight.add(task)
            task.add_done_callback(self._done)
        rest = started + self.round_s - loop.time()
        if rest > 0:
            await asyncio.sleep(rest)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("endpoint probe failed unexpectedly: %r", task.exception())

    async def _probe_and_judge(self, address: str) -> None:
        ok, refused, why = await self._probe(address)
        self._verdict(address, ok, refused, why)

    async def _probe(self, address: str) -> tuple[bool, bool, str]:
        """(healthy, connection refused, reason)."""
        # a fresh connection per probe: a pooled keep-alive socket would hide a dead process behind a reset
        try:
            r = await self._http.get(address, self.path, timeout_s=self.timeout_s, max_body=PROBE_MAX_BODY,
                                     fresh=True)
        except ConnectFailed as e:
            if e.refused:
                return False, True, "connection refused"
            return False, False, f"cannot connect: {str(e)[:200]}"
        except TimedOut:
            return False, False, f"no answer within {self.timeout_s}s"
        except HttpError as e:
            return False, False, f"{type(e).__name__}: {str(e)[:200]}"
        return 200 <= r.status < 300, False, f"HTTP {r.status}"

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
