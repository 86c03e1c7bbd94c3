"""Synced replicas split the workers' /metrics scrapes (`--replica-sync-share-metrics`): each worker is read by
one replica, the others get its samples through the sync (the gRPC mesh or NATS subjects), and a worker whose
reader goes away is read by the others again. Real mock workers (real HTTP /metrics), real sync."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from epp_extproc.app import PickerApp
from epp_extproc.config import Config, ProcessSlot
from epp_extproc.dev.nats import NatsServer
from tests.integration.test_replicas import started
from tests.mock.test_mock_support import running_worker
from tests.natsutil import nats_server  # noqa: F401  (fixture)
from tests.netutil import free_port
from tests.waiting import until_async

FAST = {"peer_timeout_ms": 1500, "peer_expiry_ms": 500, "endpoint_probe_interval_ms": 0,
        "worker_metrics_interval_ms": 50, "worker_metrics_idle_interval_ms": 50}  # idle mocks: read at the interval


@pytest.fixture
async def workers() -> AsyncIterator[list[str]]:
    """Four mock workers serving /metrics; their addresses."""
    async with contextlib.AsyncExitStack() as stack:
        ws = [await stack.enter_async_context(running_worker()) for _ in range(4)]
        yield [f"127.0.0.1:{w.port}" for w in ws]


def base(addresses: list[str], **extra: object) -> dict[str, object]:
    eps = ",".join(f"w{i}={a}" for i, a in enumerate(addresses))
    return dict(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1", endpoints=eps,
                secure_serving=False, **{**FAST, **extra})


def counting(app: PickerApp) -> dict[str, int]:
    """Record every worker this replica's scraper reads itself."""
    reads: dict[str, int] = {}
    scraper = app.scraper
    assert scraper is not None
    real = scraper.scrape_once

    async def once(address: str) -> bool:
        reads[address] = reads.get(address, 0) + 1
        return await real(address)

    scraper.scrape_once = once  # type: ignore[method-assign]
    return reads


@pytest.fixture
async def mesh(workers: list[str]) -> AsyncIterator[Callable[..., Awaitable[list[PickerApp]]]]:
    apps: list[PickerApp] = []

    async def make(n: int, **extra: object) -> list[PickerApp]:
        ports = [free_port() for _ in range(n)]
        new = []
        for p in ports:
            peers = [q for q in ports if q != p]
            cfg = Config(**base(workers, replica_sync_port=p, peers=",".join(f"127.0.0.1:{q}" for q in peers),
                                **extra))  # type: ignore[arg-type]
            cfg.validate()
            new.append(PickerApp(cfg, ProcessSlot()))
        return await started(apps, new)

    yield make
    for a in apps:
        await a.stop(0)


def fresh_everywhere(apps: list[PickerApp], workers: list[str]) -> bool:
    return all(a.detector.fresh(w) is not None for a in apps for w in workers)


def settled(apps: list[PickerApp], workers: list[str]) -> bool:
    """Every replica holds a peer's sample of each worker it does not read (after a peer joins, the workers
    that moved to it are read here once more, as takeovers, until its first samples come)."""
    now = time.monotonic()
    return fresh_everywhere(apps, workers) and all(
        a.metrics_share.owns(w) or a.metrics_share.covered(w, now)  # type: ignore[union-attr]
        for a in apps for w in workers)


def reader_and_silent(a: PickerApp, b: PickerApp, workers: list[str]) -> tuple[PickerApp, PickerApp]:
    """(x, y) with y owning at least one worker: replica ids are random, and one replica of two owns all four
    workers one time in eight."""
    theirs = [w for w in workers if not a.metrics_share.owns(w)]  # type: ignore[union-attr]
    return (a, b) if theirs else (b, a)


def shared(app: PickerApp, direction: str) -> float:
    share = app.metrics_share
    assert share is not None
    return share.shared.labels(direction)._value.get()


async def reads_over(apps: list[PickerApp], seconds: float) -> list[dict[str, int]]:
    counts = [counting(a) for a in apps]
    await asyncio.sleep(seconds)
    return counts


def takeovers(apps: list[PickerApp]) -> float:
    return sum(a.metrics_share.takeovers._value.get() for a in apps)  # type: ignore[union-attr]


def assert_one_reader_each(apps: list[PickerApp], workers: list[str], reads: list[dict[str, int]],
                           took: float) -> None:
    """Each worker read by its owner alone, every interval; a read by another replica only as a counted
    takeover (a sample late past the grace on a loaded machine), at most one per replica."""
    extra = 0
    for w in workers:
        owners = [i for i, a in enumerate(apps) if a.metrics_share.owns(w)]  # type: ignore[union-attr]
        assert len(owners) == 1, (w, owners)
        assert reads[owners[0]].get(w, 0) >= 3, (w, reads)  # 0.6 s at 50 ms: ~12
        extra += sum(r.get(w, 0) for i, r in enumerate(reads) if i != owners[0])
    assert extra == took <= len(apps), (reads, took)


async def one_reader_window(apps: list[PickerApp], workers: list[str]) -> list[dict[str, int]]:
    """Once settled, 0.6 s of reads: each worker read by one replica, every replica holding fresh samples."""
    await until_async(lambda: settled(apps, workers), "fresh samples of every worker everywhere")
    took = takeovers(apps)
    reads = await reads_over(apps, 0.6)
    assert_one_reader_each(apps, workers, reads, takeovers(apps) - took)
    assert fresh_everywhere(apps, workers)
    return reads


async def test_each_worker_is_read_by_one_replica_and_every_replica_has_its_sample(mesh, workers) -> None:  # noqa: ANN001
    apps = await mesh(2)
    await one_reader_window(apps, workers)
    for w in workers:
        assert [a.flow_snapshot()["workers"][w]["metrics_read_by"] for a in apps].count("here") == 1  # /debug/flow
    assert shared(apps[0], "received") > 0 and shared(apps[1], "received") > 0


async def test_sharing_is_on_by_default(mesh, workers) -> None:  # noqa: ANN001
    apps = await mesh(2)
    await until_async(lambda: settled(apps, workers), "settled")
    assert all(a.metrics_share is not None for a in apps)


async def test_with_sharing_off_every_replica_reads_every_worker(mesh, workers) -> None:  # noqa: ANN001
    apps = await mesh(2, replica_sync_share_metrics=False)
    await until_async(lambda: fresh_everywhere(apps, workers), "fresh samples")
    reads = await reads_over(apps, 0.6)
    assert all(set(r) == set(workers) for r in reads), reads
    assert apps[0].metrics_share is None


async def test_a_peers_sample_is_applied_as_a_scrape_of_ours(mesh, workers) -> None:  # noqa: ANN001
    a, b = await mesh(2)
    await until_async(lambda: settled([a, b], workers), "settled")
    a, b = reader_and_silent(a, b, workers)
    theirs = next(w for w in workers if not a.metrics_share.owns(w))  # type: ignore[union-attr]
    booking = b.load.book(theirs, 3)  # B's request, synced to A: both count it as booked, not as unbooked load
    await until_async(lambda: a.load.load(theirs).inflight == 1, "the booking at A")
    await until_async(lambda: (s := a.detector.fresh(theirs)) is not None and s.booked_inflight == 1,
                      "a sample taken after the booking, carrying it as ours")
    assert a.load.load(theirs).unbooked_blocks == 0.0  # the mock runs nothing: no load beyond the bookings
    booking.free()


async def test_a_replica_that_leaves_has_its_workers_read_by_the_others(mesh, workers) -> None:  # noqa: ANN001
    a, b = await mesh(2)
    await until_async(lambda: settled([a, b], workers), "settled")
    assert len(a.sync.live_replicas()) == 1  # type: ignore[union-attr]
    reads = counting(a)
    await b.stop(0)
    await until_async(lambda: set(reads) == set(workers), "A reads every worker")
    await until_async(lambda: all(a.detector.fresh(w) is not None for w in workers), "fresh samples at A")


async def test_a_worker_whose_samples_stop_coming_is_read_here_as_a_takeover(mesh, workers) -> None:  # noqa: ANN001
    """B is still a live peer (its sync heartbeats) but sends no samples (a reader stuck on a slow worker):
    A reads B's workers itself once their next sample is overdue, and counts it."""
    a, b = await mesh(2)
    await until_async(lambda: settled([a, b], workers), "settled")
    a, b = reader_and_silent(a, b, workers)  # B owns a worker: A has something to take over
    b.metrics_share.publish = lambda *args, **kw: None  # type: ignore[union-attr,method-assign]
    reads = counting(a)
    await until_async(lambda: set(reads) == set(workers), "A reads every worker", timeout=10)
    assert len(a.sync.live_replicas()) == 1  # type: ignore[union-attr]
    assert a.metrics_share.takeovers._value.get() > 0  # type: ignore[union-attr]


@pytest.fixture
async def nats_replicas(nats_server: NatsServer, workers: list[str]) \
        -> AsyncIterator[Callable[..., Awaitable[list[PickerApp]]]]:  # noqa: F811
    apps: list[PickerApp] = []

    async def make(n: int, **extra: object) -> list[PickerApp]:
        new = []
        for _ in range(n):
            cfg = Config(**base(workers, replica_sync_plane="nats", nats_url=nats_server.url, kv_plane_pool="s",
                                **extra))  # type: ignore[arg-type]
            cfg.validate()
            new.append(PickerApp(cfg))
        for a in new:
            await a.start()
            apps.append(a)
        await until_async(lambda: all(len(a.sync.live_replicas()) == n - 1 and a.ready() for a in new),
                          "every peer heard")  # type: ignore[union-attr]
        return new

    yield make
    for a in apps:
        await a.stop(0)


async def test_over_nats_each_worker_is_read_by_one_of_three_replicas(nats_replicas, workers) -> None:  # noqa: ANN001
    apps = await nats_replicas(3)
    reads = await one_reader_window(apps, workers)
    readers = sum(1 for r in reads if r)
    assert sum(shared(a, "received") > 0 for a in apps) >= min(3, readers + 1)  # each got what it did not read


async def test_samples_go_out_within_the_delay_when_no_change_carries_them(mesh, workers) -> None:  # noqa: ANN001
    """No booking traffic and a heartbeat every 2 s: the samples still reach the peer within half an
    interval of being read (a kick), so the peer never has to read the worker itself."""
    a, b = await mesh(2, peer_timeout_ms=8000, peer_expiry_ms=8000)
    await until_async(lambda: settled([a, b], workers), "settled")
    takeovers = [x.metrics_share.takeovers._value.get() for x in (a, b)]  # type: ignore[union-attr]
    worst = 0.0
    for _ in range(30):  # 1.5 s: most of a heartbeat
        await asyncio.sleep(0.05)
        now = time.monotonic()
        for x in (a, b):
            for w in workers:
                if not x.metrics_share.owns(w):  # type: ignore[union-attr]
                    s = x.detector.fresh(w)
                    worst = max(worst, math.inf if s is None else now - s.at)
    assert worst < 0.5, worst  # the interval (0.05) + the delay (0.025) + scheduling on a busy machine
    assert [x.metrics_share.takeovers._value.get() for x in (a, b)] == takeovers  # type: ignore[union-attr]
