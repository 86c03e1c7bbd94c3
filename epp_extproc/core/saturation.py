"""When a worker, and the pool, count as saturated: scraped engine gauges (adapters/worker_metrics.py)
corrected by this picker's bookings since the scrape. Flow control (core/flow_queue.py) queues while every
eligible worker is saturated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from epp_extproc.core.load import EndpointLoad


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When one worker counts as saturated (any rule). 0 turns the booked-prefill-tokens rule off."""

    queue_depth: int = 5  # requests waiting in the engine (GAIE's default queueDepthThreshold); 0 = none
    kv_utilization: float = 0.8  # fraction of KV blocks in use (GAIE's default kvCacheUtilThreshold)
    prefill_tokens: int = 0  # prompt tokens this picker has booked in prefill on the worker
    staleness_s: float = 0.3  # an older sample is ignored (the worker is judged by bookings only)


@dataclass(slots=True)
class WorkerSample:
    """One scrape of a worker's gauges, plus this picker's booking counters when the scrape was sent."""

    waiting: float
    running: float
    kv_utilization: float | None
    at: float  # monotonic time the scrape was sent
    booked_inflight: int = 0  # this picker's requests on the worker when the scrape was sent
    max_running: float | None = None  # the engine's batch capacity if it exports one


@dataclass(slots=True)
class WorkerState:
    """What the detector concluded about one worker (also shown on /debug/flow)."""

    saturated: bool
    headroom: int  # requests the worker can take before it counts as saturated
    waiting_est: float | None  # None: no fresh sample
    why: str = ""


class SaturationDetector:
    """Per-worker and pool saturation from scraped engine gauges corrected by bookings since the scrape.

    A scrape is a snapshot up to one interval old, and it cannot see requests still on their way to the
    engine. What this picker sent itself it knows exactly and at once: its bookings on the worker, made at
    pick time and freed when the response ends. So the engine's occupancy is estimated as this picker's
    bookings now plus the requests the last scrape showed beyond this picker's bookings at that time (other
    gateways, replicas, direct clients); whatever exceeds the batch capacity waits in the engine. The capacity is the engine's own gauge when it exports one
    (trtllm `trtllm_max_num_active_requests`), else the largest `running` ever seen (exact once the
    engine has had a queue). A worker is saturated when that estimated queue reaches `queue_depth`, its KV
    utilisation reaches `kv_utilization`, or (when set) the prompt tokens this picker booked in prefill on
    it reach `prefill_tokens`. Without a fresh sample (a slow or failing scrape) a worker whose batch size
    is known is judged by this picker's bookings against it; one never scraped by the bookings rule only: a
    worker that does not export metrics must not stall the pool (GAIE instead treats it as saturated).
    """

    def __init__(self, thresholds: Thresholds, loads: Callable[[], Mapping[str, EndpointLoad]],
                 block_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.thresholds = thresholds
        self._loads = loads
        self.block_size = block_size
        self.clock = clock
        self.samples: dict[str, WorkerSample] = {}
        self._max_running: dict[str, float] = {}

    def observe(self, address: str, sample: WorkerSample) -> None:
        prev = self.samples.get(address)
        if prev is not None and prev.at > sample.at:
            return  # a slow scrape finishing after a newer one
        self.samples[address] = sample
        cap = sample.max_running if sample.max_running else max(self._max_running.get(address, 0.0),
                                                                 sample.running)
        self._max_running[address] = cap

    def forget(self, address: str) -> None:
        self.samples.pop(address, None)
        self._max_running.pop(address, None)

    def fresh(self, address: str) -> WorkerSample | None:
        s = self.samples.get(address)
        if s is None or self.clock() - s.at > self.thresholds.staleness_s:
            return None
        return s

    def state(self, address: str) -> WorkerState:
        th = self.thresholds
        ld = self._loads().get(address) or EndpointLoad()
        if th.prefill_tokens > 0 and ld.prefill_blocks * self.block_size >= th.prefill_tokens:
            return WorkerState(True, 0, None, "booked prefill tokens")
        s = self.fresh(address)
        cap = self._max_running.get(address, 0.0)
        if s is None and cap > 0:
            # metrics late or failing, but its batch size is known: this picker's own bookings against it
            room = int(cap + th.queue_depth - ld.inflight)
            return WorkerState(room <= 0, max(room, 0), None, "stale metrics: bookings against the batch")
        if s is None:
            # never scraped: judged by bookings only; the prefill rule (when on) bounds it, else nothing does
            room = 1 << 30
            if th.prefill_tokens > 0:
                room = max(1, int((th.prefill_tokens - ld.prefill_blocks * self.block_size)
                                  / max(self._mean_request_tokens(ld), 1.0)))
            return WorkerState(False, room, None, "no fresh metrics")
        if s.kv_utilization is not None and s.kv_utilization >= th.kv_utilization:
            return WorkerState(True, 0, None, "kv utilization")
        # this picker's own requests are known exactly and at once (booked at pick, freed at stream end);
        # the scrape adds only what others sent, as of its last answer
        others = max(0.0, s.waiting + s.running - s.booked_inflight)
        occupancy = ld.inflight + others
        if cap > 0:
            # saturated once `queue_depth` requests would wait behind a full batch (0 = as soon as the
            # batch is full: nothing waits in the engine, where it could not be reordered)
            waiting = max(0.0, occupancy - cap)
            room = int(cap + th.queue_depth - occupancy)
        else:  # batch size not known yet (nothing seen running): requests sent since count as waiting
            waiting = s.waiting + max(0, ld.inflight - s.booked_inflight)
            room = int(max(th.queue_depth, 1) - waiting)
        if room <= 0:
            return WorkerState(True, 0, waiting, "queue depth")
        return WorkerState(False, room, waiting)

    def _mean_request_tokens(self, ld: EndpointLoad) -> float:
        return ld.prefill_blocks * self.block_size / ld.inflight if ld.inflight else float(self.block_size)

    def headroom(self, addresses: Iterable[str]) -> int:
        """Requests the given workers can take now before each is saturated (0 = all saturated)."""
        return sum(st.headroom for a in addresses if not (st := self.state(a)).saturated)

    def unbooked_requests(self, address: str) -> float:
        """Requests on the worker this picker did not send (other gateways, replicas, direct clients),
        as of the last fresh scrape; never negative."""
        s = self.fresh(address)
        if s is None:
            return 0.0
        return max(0.0, s.waiting + s.running - s.booked_inflight)
