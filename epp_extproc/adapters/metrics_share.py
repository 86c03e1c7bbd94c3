"""Synced replicas split the pool's /metrics scrapes and send each other what they read
(`--replica-sync-share-metrics`, issue 47).

Why: every picker replica used to read every worker's /metrics every 100 ms. The worker answers each GET in
the process that also serves its requests (trtllm-serve's and vLLM's API server; the mock's one event loop),
so each extra replica cost each worker one more scrape per interval: with three replicas on this machine's
4-worker pool, 12.2-12.6 ms of worker CPU per request against 9.0 with one (bench/README.md, "Where the three
pickers' extra CPU lands"), ~0.17 ms of the mock's CPU per /metrics GET.

How: each worker has one owner among the live replicas, by rendezvous hashing of (replica id, worker address)
over this replica and the peers its sync sees connected (`live_replicas`): every replica computes the same
owner from the same set, a replica that joins or leaves moves only its own share, and no election is needed.
The owner scrapes as before and hands each sample to the sync, which carries it in the next batch it sends
anyway (a booking, a heartbeat), or after `max_delay_s` at the latest (`kick`): sharing adds few messages. A
receiver applies the sample as if it had scraped it (its own bookings, which the sync makes everyone's, are
the "ours" of the unbooked load) and holds the worker as covered until the owner's next read (`next_ms`)
plus a grace; a worker nobody covers (its owner gone, slow or not scraping it) is scraped here again at the
next round, counted as a takeover. Views of the live set may differ for a moment: then a worker is read twice,
or once late, never left unread past the grace.

Bounded: at most one pending sample per worker (the latest wins), the values checked (finite, not negative,
utilisation at most 1), the cover a peer may claim capped at `MAX_NEXT_S`, a batch's loads cut at the pool
size a message may carry. A malformed sample is refused and counted, like a malformed booking.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter

from epp_extproc.proto_gen.epp.v1 import replica_sync_pb2 as pb

MAX_NEXT_S = 10.0  # the longest a peer's sample keeps a worker covered past its own age
MAX_LOADS = 4096  # per batch applied: bounded work per message, as the predictions are
MAX_VALUE = 1e9  # requests waiting or running: past this the sample is nonsense


class LoadPlane(Protocol):
    """What the share needs of a replica sync (either plane)."""

    replica_id: str

    def live_replicas(self) -> list[str]:
        """The peers this replica exchanges with now (not itself)."""
        ...

    def offer_loads(self, loads: Sequence[pb.WorkerLoad]) -> None:
        """Queue samples for the next batch without sending one for them alone."""
        ...

    def kick(self) -> None:
        """Send what is queued now."""
        ...


# (address, waiting, running, kv utilisation, max running, when it was read): True when applied (a worker of
# this pool)
RemoteSample = Callable[[str, float, float, float | None, float | None, float], bool]


def owner_of(address: str, replicas: Sequence[str]) -> str:
    """The replica that reads `address` (rendezvous hashing: the highest hash of replica + address). A
    keyed BLAKE2b, not crc32: crc32 is linear, and on similar ids it gave one replica of three half the pool."""
    key = address.encode()
    return max(replicas, key=lambda r: (blake2b(key, digest_size=8, key=r.encode()[:64]).digest(), r))


class MetricsShare:
    """Which workers this replica reads, what it tells its peers, and what they told it."""

    def __init__(self, plane: LoadPlane, *, max_delay_s: float, grace_s: float = 0.0,
                 registry: CollectorRegistry | None = None) -> None:
        self.plane = plane
        self.max_delay_s = max_delay_s  # a sample waits at most this for a batch going out anyway
        # past the owner's announced next read, the worker is read here (the scraper sets it: `share_with`)
        self.grace_s = grace_s
        self.on_remote: RemoteSample | None = None  # (address, waiting, running, kv, max_running, sent)
        self._covered_until: dict[str, float] = {}  # monotonic; a peer's sample said it reads the worker
        self._owners: dict[str, bool] = {}  # address -> this replica owns it, for `_owners_of`
        self._owners_of: tuple[str, ...] = ()
        self._kick: asyncio.TimerHandle | None = None
        r = registry or CollectorRegistry()
        self.shared = Counter("epp_worker_metrics_shared", "Worker metric samples exchanged with the other "
                              "replicas (--replica-sync-share-metrics), by direction (sent, received, refused)",
                              ["direction"], registry=r)
        self.takeovers = Counter("epp_worker_metrics_takeovers", "Scrapes of a worker another live replica "
                                 "owns, made because no sample of it came in time", registry=r)

    def peers(self) -> list[str]:
        return self.plane.live_replicas()

    def owns(self, address: str) -> bool:
        """This replica reads `address` (always, without live peers)."""
        live = tuple(sorted(self.peers()))
        if not live:
            return True
        if live != self._owners_of:
            self._owners_of = live
            self._owners.clear()
        mine = self._owners.get(address)
        if mine is None:  # (`forget` keeps the cache near the pool's size)
            mine = self._owners[address] = owner_of(address, (*live, self.plane.replica_id)) == \
                self.plane.replica_id
        return mine

    def covered(self, address: str, now: float) -> bool:
        """A peer's sample of `address` came and its next is not overdue yet."""
        return self._covered_until.get(address, 0.0) > now

    def should_read(self, address: str, now: float) -> bool:
        """Scrape `address` here this round: ours, or nobody's sample is on time (a takeover, counted)."""
        if self.owns(address):
            return True
        if self.covered(address, now):
            return False
        self.takeovers.inc()
        return True

    def forget(self, known: set[str]) -> None:
        """Drop the state of workers that left the pool."""
        for a in [a for a in self._covered_until if a not in known]:
            del self._covered_until[a]
        if len(self._owners) > 2 * len(known) + 64:
            self._owners.clear()

    def publish(self, address: str, waiting: float | None, running: float | None, kv: float | None,
                max_running: float | None, age_s: float, next_s: float) -> None:
        """A sample this replica read goes to the peers, with the next batch or within `max_delay_s`."""
        if not self.peers():
            return
        wl = pb.WorkerLoad(address=address, waiting=waiting or 0.0, running=running or 0.0,
                           age_us=min(int(max(age_s, 0.0) * 1e6), 0xFFFFFFFF),
                           next_ms=min(int(max(next_s, 0.0) * 1000), 0xFFFFFFFF))
        if kv is not None:
            wl.kv_utilization = kv
        if max_running is not None:
            wl.max_running = max_running
        self.plane.offer_loads((wl,))
        self.shared.labels("sent").inc()
        if self._kick is None:
            self._kick = asyncio.get_running_loop().call_later(self.max_delay_s, self._send)

    def _send(self) -> None:
        self._kick = None
        self.plane.kick()

    def close(self) -> None:
        if self._kick is not None:
            self._kick.cancel()
            self._kick = None

    def receive(self, peer: str, loads: Sequence[pb.WorkerLoad]) -> None:
        """A peer's samples (from a batch of either plane): applied as if read here; the bad ones refused."""
        now = time.monotonic()
        for wl in loads[:MAX_LOADS]:
            kv = wl.kv_utilization if wl.HasField("kv_utilization") else None
            mr = wl.max_running if wl.HasField("max_running") else None
            if not wl.address or not all(_ok(v) for v in (wl.waiting, wl.running, mr)) or \
                    (kv is not None and not 0.0 <= kv <= 1.0):
                self.shared.labels("refused").inc()
                continue
            self.shared.labels("received").inc()
            read_at = now - min(wl.age_us / 1e6, MAX_NEXT_S)
            if self.on_remote is not None and self.on_remote(wl.address, wl.waiting, wl.running, kv, mr, read_at):
                # only workers of this pool are held: a peer cannot grow this map with addresses
                self._covered_until[wl.address] = now + min(wl.next_ms / 1000, MAX_NEXT_S) + self.grace_s


def _ok(v: float | None) -> bool:
    return v is None or (math.isfinite(v) and 0.0 <= v <= MAX_VALUE)
