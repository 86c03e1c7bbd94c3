"""Splitting the workers' /metrics reads between synced replicas (`MetricsShare`): who reads which worker,
what a peer may claim, and how samples leave (with a batch going out anyway, else after a short delay)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

from epp_extproc.adapters.metrics_share import MAX_NEXT_S, MetricsShare, owner_of
from epp_extproc.adapters.replica_sync import apply_batch
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.proto_gen.epp.v1 import replica_sync_pb2 as pb

WORKERS = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(1000)]


class Plane:
    """A sync's side of the share, recorded."""

    def __init__(self, replica_id: str = "a", peers: Sequence[str] = ("b",)) -> None:
        self.replica_id = replica_id
        self.peers = list(peers)
        self.offered: list[pb.WorkerLoad] = []
        self.kicks = 0

    def live_replicas(self) -> list[str]:
        return self.peers

    def offer_loads(self, loads: Sequence[pb.WorkerLoad]) -> None:
        self.offered.extend(loads)

    def kick(self) -> None:
        self.kicks += 1


def test_every_replica_computes_the_same_owner_whatever_the_order_it_lists_them() -> None:
    for w in WORKERS[:200]:
        assert owner_of(w, ["r1", "r2", "r3"]) == owner_of(w, ["r3", "r1", "r2"]) == owner_of(w, ["r2", "r3", "r1"])


def test_the_workers_spread_over_the_replicas() -> None:
    counts: dict[str, int] = {}
    for w in WORKERS:
        o = owner_of(w, ["pod-a", "pod-b", "pod-c"])
        counts[o] = counts.get(o, 0) + 1
    assert all(250 <= n <= 420 for n in counts.values()), counts


def test_a_replica_that_leaves_moves_only_its_own_workers() -> None:
    before = {w: owner_of(w, ["r1", "r2", "r3"]) for w in WORKERS}
    after = {w: owner_of(w, ["r1", "r3"]) for w in WORKERS}
    assert all(after[w] == before[w] for w in WORKERS if before[w] != "r2")
    assert {after[w] for w in WORKERS if before[w] == "r2"} == {"r1", "r3"}


def test_a_replica_without_live_peers_reads_every_worker() -> None:
    share = MetricsShare(Plane(peers=()), max_delay_s=0.05, grace_s=0.5)
    assert all(share.owns(w) for w in WORKERS[:100])


def test_two_replicas_own_complementary_halves() -> None:
    a = MetricsShare(Plane("a", ["b"]), max_delay_s=0.05, grace_s=0.5)
    b = MetricsShare(Plane("b", ["a"]), max_delay_s=0.05, grace_s=0.5)
    assert all(a.owns(w) != b.owns(w) for w in WORKERS)


def sample(address: str = "w:1", **kw: object) -> pb.WorkerLoad:
    wl = pb.WorkerLoad(address=address, waiting=1.0, running=2.0, age_us=1000, next_ms=100)
    for k, v in kw.items():
        setattr(wl, k, v)
    return wl


def receiving(known: set[str] | None = None) -> tuple[MetricsShare, list[tuple[object, ...]]]:
    share = MetricsShare(Plane(), max_delay_s=0.05, grace_s=0.5)
    got: list[tuple[object, ...]] = []

    def on_remote(address: str, *rest: object) -> bool:
        got.append((address, *rest))
        return known is None or address in known

    share.on_remote = on_remote
    return share, got


def test_a_peers_sample_is_applied_with_its_age() -> None:
    share, got = receiving()
    before = time.monotonic()
    share.receive("b", [sample(kv_utilization=0.5, age_us=20_000)])
    ((address, waiting, running, kv, max_running, read_at),) = got
    assert (address, waiting, running, kv, max_running) == ("w:1", 1.0, 2.0, 0.5, None)
    assert before - 0.021 <= read_at <= time.monotonic() - 0.02  # type: ignore[operator]
    assert share.covered("w:1", time.monotonic())


def test_malformed_samples_are_refused_and_counted() -> None:
    share, got = receiving()
    bad = [sample(waiting=-1.0), sample(running=math.nan), sample(kv_utilization=1.5),
           sample(max_running=math.inf), sample(address=""), sample(waiting=1e12)]
    share.receive("b", bad)
    assert got == []
    assert share.shared.labels("refused")._value.get() == len(bad)
    assert not share.covered("w:1", time.monotonic())


def test_a_sample_of_a_worker_outside_the_pool_leaves_nothing_held() -> None:
    share, got = receiving(known={"w:1"})
    share.receive("b", [sample("elsewhere:1"), sample("w:1")])
    assert [g[0] for g in got] == ["elsewhere:1", "w:1"]
    now = time.monotonic()
    assert share.covered("w:1", now) and not share.covered("elsewhere:1", now)


def test_a_peer_cannot_claim_a_worker_for_longer_than_the_cap() -> None:
    share, _ = receiving()
    share.receive("b", [sample(next_ms=0xFFFFFFFF)])
    now = time.monotonic()
    assert share.covered("w:1", now + MAX_NEXT_S) and not share.covered("w:1", now + MAX_NEXT_S + 0.5 + 0.01)


def test_an_uncovered_worker_of_a_peer_is_read_here_and_counted_as_a_takeover() -> None:
    share, _ = receiving()
    theirs = next(w for w in WORKERS if not share.owns(w))
    now = time.monotonic()
    assert share.should_read(theirs, now) and share.takeovers._value.get() == 1
    share.receive("b", [sample(theirs)])
    assert not share.should_read(theirs, time.monotonic())
    assert share.should_read(theirs, time.monotonic() + 0.1 + 0.5 + 0.01)  # its next read is overdue
    assert share.takeovers._value.get() == 2


async def test_samples_wait_for_a_batch_and_are_kicked_out_once_after_the_delay() -> None:
    plane = Plane()
    share = MetricsShare(plane, max_delay_s=0.03, grace_s=0.5)
    share.publish("w:1", 1.0, 2.0, 0.25, None, 0.001, 0.1)
    share.publish("w:2", 0.0, 0.0, None, 8.0, 0.001, 0.1)
    assert [w.address for w in plane.offered] == ["w:1", "w:2"] and plane.kicks == 0
    assert plane.offered[0].kv_utilization == 0.25 and not plane.offered[1].HasField("kv_utilization")
    assert plane.offered[1].max_running == 8.0 and plane.offered[0].next_ms == 100
    await asyncio.sleep(0.06)
    assert plane.kicks == 1


async def test_a_replica_alone_publishes_nothing() -> None:
    plane = Plane(peers=())
    share = MetricsShare(plane, max_delay_s=0.01, grace_s=0.5)
    share.publish("w:1", 1.0, 2.0, None, None, 0.0, 0.1)
    await asyncio.sleep(0.02)
    assert plane.offered == [] and plane.kicks == 0


def test_a_receiver_without_sharing_ignores_the_samples_in_a_batch() -> None:
    """A replica with the flag off (or of an earlier release) applies the rest of the batch as before."""
    load, reg = LoadTracker(), EndpointRegistry()
    reg.replace([Endpoint("w", "w:1")])
    batch = pb.Batch(seq=1, deltas=[pb.BookingDelta(kind=pb.BookingDelta.BOOK, id="x", address="w:1",
                                                    prefill_blocks=2, decode_blocks=2)], loads=[sample()])
    apply_batch(load, reg, None, "b", batch)
    assert load.load("w:1").inflight == 1
    got: list[tuple[str, int]] = []
    apply_batch(load, reg, None, "b", pb.Batch(seq=2, loads=[sample(), sample("w:2")]), None,
                lambda peer, loads: got.append((peer, len(loads))))
    assert got == [("b", 2)]
