"""Scrape each worker's Prometheus /metrics for the load the engine itself reports.

Flow control needs to know when a worker is full, and the cost needs the load this picker did not book.
Both come from the engines' standard gauges (names checked against each engine's source and GAIE's
model-server protocol):

| engine | waiting | running | KV utilisation (0..1) |
|---|---|---|---|
| trtllm-serve | `trtllm_num_requests_waiting` | `trtllm_num_requests_running` | `trtllm_kv_cache_utilization` |
| vLLM | `vllm:num_requests_waiting` | `vllm:num_requests_running` | `vllm:kv_cache_usage_perc` (older `vllm:gpu_cache_usage_perc`) |
| SGLang | `sglang:num_queue_reqs` | `sglang:num_running_reqs` | `sglang:token_usage` |

(SGLang also appears with `_` instead of `:`; both are read.) Series with labels (vLLM's `engine`, data
parallel ranks) are summed for the request counts and the maximum is taken for utilisation: one full rank
is enough for requests routed to it to queue.

This module is the one reader of a worker's /metrics (`read_metrics`; `server_info` asks it for the block
size gauge). Cost is bounded: kept-alive connections per worker (`WorkerHttp` over `http1.Origin`, ~4x
less CPU per GET than aiohttp's client), at most one GET per worker in flight, the body read up to `max_bytes` (a larger answer is an error,
not a partial parse; a gzip body a server sends unasked is capped after decompression), and only the lines
of the names above are looked at, found with `str.find` rather than a scan of every line (a vLLM /metrics is
mostly histograms). Parsing runs in the scraper task, never on a request's path.

An idle worker is read less often: once two scrapes in a row found nothing running or waiting on it and this
picker has nothing booked there, the next scrape waits twice as long each time, up to `idle_interval_s`
(1 s by default against the 100 ms interval). The first booking on it brings it back to the interval at the
next tick. While it is read slowly its sample goes stale and flow control judges it, as it does a worker
whose metrics are late, by this picker's bookings against its known batch size; traffic from other gateways
to a worker this picker is not using is seen within `idle_interval_s`.

Total cost is bounded whatever the pool size, as the prober's (adapters/endpoint_probe.py): at most `max_rate`
scrapes per second over the pool. A round sends every scrape that is due; when they are more than
`max_rate x interval`, the round stretches to due / max_rate (`round_length`) and the scrapes are spread
evenly over it in a random order, so each worker is read every due / max_rate seconds instead of every
interval (1,000 idle workers at the default 500/s: every 2 s, not every 1 s; 1,000 busy ones: every 2 s, not
every 100 ms), and the picker never sends more than `max_rate` GETs a second. Below that the round is
today's: every due scrape at the start of each interval.

Synced replicas can split the reads (`share_with`, `--replica-sync-share-metrics`, adapters/metrics_share.py):
each worker is then read by one of them and the others apply its samples (`observe_remote`) as scrapes of
their own, so a worker answers one GET per interval however many replicas there are.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from epp_extproc.adapters.endpoint_probe import round_length
from epp_extproc.adapters.metrics_share import MetricsShare
from epp_extproc.adapters.worker_http import BodyTooLarge, HttpError, TimedOut, WorkerHttp
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.saturation import SaturationDetector, WorkerSample
from kvindex.aio import cancel_and_wait
from kvindex.backoff import backoff_delay

log = logging.getLogger(__name__)

WAITING = ("trtllm_num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs",
           "sglang_num_queue_reqs")
RUNNING = ("trtllm_num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs",
           "sglang_num_running_reqs")
KV_UTIL = ("trtllm_kv_cache_utilization", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
           "sglang:token_usage", "sglang_token_usage")
MAX_RUNNING = ("trtllm_max_num_active_requests",)
_KIND = {**{n: "waiting" for n in WAITING}, **{n: "running" for n in RUNNING},
         **{n: "kv" for n in KV_UTIL}, **{n: "max_running" for n in MAX_RUNNING}}
MAX_BACKOFF_S = 5.0
IDLE_INTERVAL_S = 1.0
DEFAULT_MAX_RATE = 500.0  # scrapes per second over the whole pool
PACE_STEP_S = 0.01  # a paced round wakes at most every 10 ms: one wake-up per scrape cost as much as it saved


@dataclass(slots=True)
class EngineGauges:
    waiting: float | None = None
    running: float | None = None
    kv_utilization: float | None = None
    max_running: float | None = None


def parse_gauges(text: str) -> EngineGauges:
    """The four gauges from Prometheus text exposition; names absent from the text stay None.

    When an engine exports both vLLM KV names (during the deprecation) the maximum wins, which is the same
    value. A utilisation above 1 is read as a percentage (some exporters scale it).
    """
    sums: dict[str, float] = {}
    for name, kind in _KIND.items():
        start = 0
        while True:
            i = text.find(name, start)
            if i < 0:
                break
            start = i + len(name)
            if i and text[i - 1] != "\n":
                continue  # inside a line: a comment (# HELP / # TYPE), a label value, another name
            end = text.find("\n", start)
            value = _sample_value(text[start:end if end >= 0 else len(text)])
            if value is None:
                continue
            if kind == "kv" or kind == "max_running":
                sums[kind] = max(sums.get(kind, 0.0), value)
            else:
                sums[kind] = sums.get(kind, 0.0) + value
    kv = sums.get("kv")
    if kv is not None and kv > 1.0:
        kv = min(kv / 100.0, 1.0)
    return EngineGauges(sums.get("waiting"), sums.get("running"), kv, sums.get("max_running"))


def _sample_value(rest: str) -> float | None:
    """The value of one sample line after its metric name: `{labels} value [timestamp]` or ` value ...`;
    None for another metric that merely starts with the name (`..._total`) or a value we do not take."""
    if rest.startswith("{"):
        close = rest.rfind("}")
        if close < 0:
            return None
        rest = rest[close + 1:]
    elif not rest.startswith((" ", "\t")):
        return None
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return value


class MetricsError(Exception):
    """A /metrics answer that is not usable (status, size, encoding); the message says why."""


async def read_metrics(http: WorkerHttp, address: str, *, path: str = "/metrics", timeout_s: float | None = None,
                       max_bytes: int = 4 * 1024 * 1024) -> str:
    """A worker's Prometheus exposition as text (decompressed if the server gzipped it unasked, capped after
    decompression). Raises `TimedOut`/`HttpError` when no answer came, `MetricsError` for an unusable one."""
    try:
        r = await http.get(address, path, timeout_s=timeout_s, max_body=max_bytes)
    except BodyTooLarge as e:
        if e.status != 200:
            raise MetricsError(f"HTTP {e.status}") from None
        raise MetricsError(f"answer larger than {max_bytes} bytes") from None
    if r.status != 200:
        raise MetricsError(f"HTTP {r.status}")
    body = r.body
    encoding = r.headers.get("content-encoding", "").strip().lower()
    if encoding in ("gzip", "deflate"):  # not asked for, but some exporters compress anyway
        try:
            d = zlib.decompressobj(wbits=47 if encoding == "gzip" else 15)
            body = d.decompress(body, max_bytes + 1)
        except zlib.error as e:
            raise MetricsError(f"bad {encoding} body: {e}") from None
    if len(body) > max_bytes:
        raise MetricsError(f"answer larger than {max_bytes} bytes")
    return body.decode("utf-8", "replace")


class WorkerMetricsScraper:
    """Polls every known endpoint's metrics path and feeds the saturation detector and the cost.

    After each scrape: the detector gets a `WorkerSample` (with this picker's bookings on the worker as
    they were when the GET was sent), `EndpointLoad.unbooked_blocks` is set to the requests the engine reports
    beyond this picker's own bookings times the mean blocks of a booking, and `on_sample` runs (flow
    control dispatches). A failed or non-metrics answer zeroes the unbooked load and leaves the sample to
    go stale; a worker whose scrapes keep failing (other than by timing out: a busy engine is still one)
    is retried by the house's backoff (`kvindex.backoff`, up to 5 s).
    """

    def __init__(self, registry: EndpointRegistry, load: LoadTracker, detector: SaturationDetector, *,
                 interval_s: float = 0.1, timeout_s: float | None = None, path: str = "/metrics",
                 max_bytes: int = 4 * 1024 * 1024, on_sample: Callable[[], None] | None = None,
                 on_error: Callable[[str, str], None] | None = None,
                 idle_interval_s: float = IDLE_INTERVAL_S, http: WorkerHttp | None = None,
                 max_rate: float = DEFAULT_MAX_RATE, rng: random.Random | None = None) -> None:
        if max_rate <= 0:
            raise ValueError("max_rate must be positive")
        self.registry = registry
        self.load = load
        self.detector = detector
        self.interval_s = interval_s
        # longer than the interval on purpose: a busy engine answers late, and a late sample beats none
        # (there is never more than one scrape per worker in flight)
        self.timeout_s = timeout_s if timeout_s is not None else max(0.5, min(2.0, 4 * interval_s))
        self.path = path if path.startswith("/") else "/" + path
        self.max_bytes = max_bytes
        self.on_sample = on_sample
        self.on_error = on_error
        self.idle_interval_s = idle_interval_s  # <= interval_s: idle workers are read like busy ones
        self.max_rate = max_rate
        self.round_s = interval_s  # how long the current round lasts: interval, or due / max_rate when longer
        self._rng = rng or random.Random()
        self._http = http or WorkerHttp(timeout_s=self.timeout_s, max_body=max_bytes)
        self._inflight: set[str] = set()  # one outstanding scrape per worker, whatever its latency
        self._mean_blocks = 1.0  # blocks of an average booking of this picker (weight of unbooked load)
        self._errors_logged: set[str] = set()
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}  # failing workers are retried less often, up to MAX_BACKOFF_S
        self._idle_streak: dict[str, int] = {}  # scrapes in a row that found the worker idle
        self._idle_until: dict[str, float] = {}  # an idle worker's next scrape, unless this picker books on it
        self.scrapes = 0  # GETs sent (tests, /debug)
        self.share: MetricsShare | None = None  # synced replicas split the scrapes (`share_with`)

    def share_with(self, share: MetricsShare) -> None:
        """Read only the workers `share` gives this replica (and those nobody else read in time); apply the
        peers' samples of the others as if read here."""
        self.share = share
        share.on_remote = self.observe_remote
        share.grace_s = self.timeout_s + self.interval_s  # a late answer, then one more interval

    async def run(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                started = time.monotonic()
                self._update_mean()
                known = {ep.address for ep in self.registry.all()}
                for address in list(self.detector.samples):
                    if address not in known:
                        self.detector.forget(address)
                for gone in [a for a in self._failures if a not in known]:
                    self._failures.pop(gone, None)
                    self._retry_at.pop(gone, None)
                for gone in [a for a in self._idle_streak.keys() | self._idle_until.keys() if a not in known]:
                    self._idle_streak.pop(gone, None)
                    self._idle_until.pop(gone, None)
                await self._http.retain(known)
                now = time.monotonic()
                share = self.share
                if share is not None:
                    share.forget(known)
                due = [a for a in known - self._inflight
                       if self._retry_at.get(a, 0.0) <= now  # else backing off a worker whose metrics keep failing
                       and self._due_while_idle(a, now)
                       and (share is None or share.should_read(a, now))]  # else a peer reads it for us
                self.round_s = round_length(self.interval_s, len(due), self.max_rate)
                spread = self.round_s > self.interval_s  # over budget: pace the round as the prober does
                if spread:
                    self._rng.shuffle(due)
                slot = self.round_s / len(due) if due else 0.0
                for i, address in enumerate(due):
                    if spread and (delay := started + i * slot - time.monotonic()) > PACE_STEP_S:
                        await asyncio.sleep(delay)  # (the scrapes due within a step leave together: one wake-up)
                    if address not in self.registry or address in self._inflight:
                        continue  # gone while the round was paced
                    self._inflight.add(address)
                    t = asyncio.create_task(self._scrape(address))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                await asyncio.sleep(max(0.0, self.round_s - (time.monotonic() - started)))
        finally:
            await cancel_and_wait(list(tasks))
            await self.close()

    async def close(self) -> None:
        await self._http.close()

    def _due_while_idle(self, address: str, now: float) -> bool:
        until = self._idle_until.get(address)
        if until is None or until <= now:
            return True
        ld = self.load.loads().get(address)
        if ld is not None and ld.inflight > 0:  # this picker sends it work again: back to the interval
            self._idle_until.pop(address, None)
            self._idle_streak.pop(address, None)
            return True
        return False

    def _note_idle(self, address: str, idle: bool) -> None:
        if not idle or self.idle_interval_s <= self.interval_s:
            self._idle_streak.pop(address, None)
            self._idle_until.pop(address, None)
            return
        n = self._idle_streak[address] = self._idle_streak.get(address, 0) + 1
        if n >= 2:
            wait = min(self.idle_interval_s, self.interval_s * 2 ** (n - 1))
            self._idle_until[address] = time.monotonic() + wait

    def _update_mean(self) -> None:
        inflight = blocks = 0.0
        for ld in self.load.loads().values():
            inflight += ld.inflight
            blocks += ld.decode_blocks
        if inflight:
            self._mean_blocks = blocks / inflight

    async def _scrape(self, address: str) -> None:
        try:
            await self.scrape_once(address)
        finally:
            self._inflight.discard(address)

    async def scrape_once(self, address: str) -> bool:
        """One scrape of one worker; True when it produced a sample."""
        ld = self.load.load(address)
        inflight = ld.inflight
        sent = time.monotonic()
        self.scrapes += 1
        try:
            text = await read_metrics(self._http, address, path=self.path, timeout_s=self.timeout_s,
                                      max_bytes=self.max_bytes)
        except TimedOut:
            return self._failed(address, f"no answer within {self.timeout_s}s", backoff=False)
        except MetricsError as e:
            return self._failed(address, str(e))
        except HttpError as e:
            return self._failed(address, f"{type(e).__name__}: {e}")
        g = parse_gauges(text)
        if g.waiting is None and g.running is None and g.kv_utilization is None:
            return self._failed(address, "no known engine gauge in the answer")
        if address not in self.registry:
            return False
        # this picker's requests the worker may have counted: those booked when the GET left and those
        # booked while it was answered (the larger); a request of ours would otherwise pass for another
        # gateway's until the next scrape and keep a free slot idle
        ours = max(inflight, self.load.load(address).inflight)
        self._observe(address, g.waiting or 0.0, g.running or 0.0, g.kv_utilization, g.max_running, sent, ours)
        self._errors_logged.discard(address)
        self._failures.pop(address, None)
        self._retry_at.pop(address, None)
        if self.share is not None:
            now = time.monotonic()
            until = self._idle_until.get(address)
            self.share.publish(address, g.waiting, g.running, g.kv_utilization, g.max_running, now - sent,
                               max(self.round_s, until - now if until is not None else 0.0))
        if self.on_sample is not None:
            self.on_sample()
        return True

    def observe_remote(self, address: str, waiting: float, running: float, kv: float | None,
                       max_running: float | None, read_at: float) -> bool:
        """A peer's sample of `address`, read at `read_at` (this clock): applied as a scrape of ours is,
        with this replica's bookings (the sync makes them every replica's) as the ones the worker counted.
        False for a worker that is not in this pool."""
        if address not in self.registry:
            return False
        self._observe(address, waiting, running, kv, max_running, read_at, self.load.load(address).inflight)
        if self.on_sample is not None:
            self.on_sample()
        return True

    def _observe(self, address: str, waiting: float, running: float, kv: float | None,
                 max_running: float | None, sent: float, ours: int) -> None:
        self.detector.observe(address, WorkerSample(waiting, running, kv, sent, ours, max_running))
        self._note_idle(address, not waiting and not running and ours == 0)
        self.load.set_unbooked(address, self.detector.unbooked_requests(address) * self._mean_blocks)

    def _failed(self, address: str, why: str, backoff: bool = True) -> bool:
        self._note_idle(address, False)
        n = self._failures[address] = self._failures.get(address, 0) + 1
        if backoff and n >= 2:  # a worker without metrics (404, not an engine) costs one GET per MAX_BACKOFF_S
            self._retry_at[address] = time.monotonic() + backoff_delay(n - 1, self.interval_s, MAX_BACKOFF_S)
        if address in self.load.loads():
            self.load.set_unbooked(address, 0.0)
        if address not in self._errors_logged:
            self._errors_logged.add(address)
            log.warning("cannot read engine metrics of %s (%s): it is judged by this picker's bookings only "
                        "until a scrape succeeds", address, why)
        if self.on_error is not None:
            self.on_error(address, why)
        return False
