"""Replicas sharing bookings and predictions over NATS subjects (`--replica-sync-plane nats`), on a real
nats-server: the mesh's behaviours (tests/integration/test_replicas.py) without a peer list."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.aio.client import Client

from epp_extproc.adapters.kv_routing import Prompt
from epp_extproc.adapters.replica_sync_nats import NatsReplicaSync
from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.dev.nats import NatsServer
from tests.natsutil import nats_server  # noqa: F401  (fixture)
from tests.waiting import until_async

WORKER = "127.0.0.1:1"
FAST = {"peer_timeout_ms": 1500, "peer_expiry_ms": 500}


def replica(server: NatsServer, **extra: object) -> PickerApp:
    cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1", endpoints=f"w={WORKER}",
                 endpoint_probe_interval_ms=0, secure_serving=False, replica_sync_plane="nats",
                 nats_url=server.url, kv_plane_pool="r", **{**FAST, **extra})  # type: ignore[arg-type]
    cfg.validate()
    return PickerApp(cfg)


def sync(app: PickerApp) -> NatsReplicaSync:
    assert isinstance(app.sync, NatsReplicaSync)
    return app.sync


@pytest.fixture
async def replicas(nats_server) -> AsyncIterator[Callable[..., Awaitable[list[PickerApp]]]]:  # noqa: F811
    apps: list[PickerApp] = []

    async def make(n: int, **extra: object) -> list[PickerApp]:
        new = [replica(nats_server, **extra) for _ in range(n)]
        for a in new:
            await a.start()
            apps.append(a)
        everyone = len(apps) - 1
        await until_async(lambda: all(len(sync(a).peers) == everyone and a.ready() for a in new), "every peer heard")
        return new

    yield make
    for a in apps:
        await a.stop(0)


async def test_a_booking_on_one_replica_is_load_on_the_others(replicas) -> None:
    a, b, c = await replicas(3)
    booking = a.load.book(WORKER, 10)
    await until_async(lambda: all(x.load.load(WORKER).prefill_blocks == 10 for x in (b, c)), "the booking at B, C")
    booking.free()
    await until_async(lambda: all(x.load.load(WORKER).inflight == 0 for x in (b, c)), "the free at B, C")


async def test_a_first_chunk_seen_by_another_replica_ends_the_prefill_where_it_was_booked(replicas) -> None:
    """As on the mesh: B is shown A's first chunk (Envoy's observer stream went to B) and publishes it; A
    ends the booking's prefill, and its PREFILL_DONE reaches C."""
    a, b, c = await replicas(3)
    booking = a.load.book(WORKER, 10)
    await until_async(lambda: all(x.load.load(WORKER).prefill_blocks == 10 for x in (b, c)), "the booking at B, C")
    b.picker.first_chunk(booking.id)
    await until_async(lambda: not booking.prefilling, "prefill done at A")
    await until_async(lambda: all(x.load.load(WORKER).prefill_blocks == 0 for x in (a, b, c)), "prefill 0 at A, B, C")


async def test_a_prediction_on_one_replica_credits_the_others(replicas) -> None:
    a, b = await replicas(2, tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1",
                          prediction_ttl_s=5.0)
    assert a.kv is not None and b.kv is not None
    prompt = Prompt(list(range(200)), None)
    a.kv.predict(WORKER, prompt)
    await until_async(lambda: b.kv.overlap(prompt, [WORKER]).get(WORKER, 0) > 0, "the prediction at B")


async def test_a_new_replica_gets_the_others_bookings_from_their_snapshots(replicas) -> None:
    a, b = await replicas(2)
    a.load.book(WORKER, 7)
    await until_async(lambda: b.load.load(WORKER).prefill_blocks == 7)
    (c,) = await replicas(1)
    await until_async(lambda: c.load.load(WORKER).prefill_blocks == 7, "the snapshot at the newcomer")


async def test_a_silent_replicas_bookings_expire(replicas) -> None:
    a, b = await replicas(2)
    a.load.book(WORKER, 5)
    await until_async(lambda: b.load.load(WORKER).inflight == 1)
    await sync(a).close()  # gone without a word (its frees never come)
    await until_async(lambda: b.load.load(WORKER).inflight == 0, "the expiry", timeout=15)


async def test_a_malformed_message_on_the_sync_subjects_is_refused(replicas, nats_server) -> None:  # noqa: F811
    a, b = await replicas(2)
    nc = Client()
    await nc.connect(nats_server.url)
    await nc.publish("epp.sync.r.r.someone-123", b"KVS1 garbage")
    await nc.flush()
    await until_async(lambda: sync(b).refused._value.get() >= 1 and sync(a).refused._value.get() >= 1)
    a.load.book(WORKER, 3)
    await until_async(lambda: b.load.load(WORKER).prefill_blocks == 3, "sync goes on")
    await nc.close()


async def test_visible_lag_of_a_booking_is_milliseconds(replicas) -> None:
    a, b = await replicas(2)
    lags = []
    for i in range(20):
        t0 = time.perf_counter()
        bk = a.load.book(WORKER, i + 1)
        await until_async(lambda i=i: b.load.load(WORKER).prefill_blocks == i + 1, interval=0.0005)
        lags.append(time.perf_counter() - t0)
        bk.free()
        await until_async(lambda: b.load.load(WORKER).inflight == 0, interval=0.0005)
    lags.sort()
    print(f"booking visible at the peer: p50 {lags[10] * 1000:.2f} ms, max {lags[-1] * 1000:.2f} ms")
    assert lags[10] < 0.1


async def test_a_replicas_own_batches_never_come_back_to_it(replicas) -> None:
    """Issue 47: every replica subscribes to the pool's subjects, its own among them. Its own batches must not
    be delivered back to it (the server's echo): it only parsed them to drop them, a third of the sync's
    receive work with three replicas, on the CPU a single host shares with Envoy and the workers."""
    (a,) = await replicas(1)
    nc = sync(a).link.nc
    assert nc is not None
    received, sent = nc.stats["in_msgs"], nc.stats["out_msgs"]
    for _ in range(5):
        a.load.book(WORKER, 3).free()
        await until_async(lambda: not sync(a)._pending, "the batch published")
    await nc.flush()
    await until_async(lambda: nc.stats["out_msgs"] >= sent + 5, "five batches published")
    await nc.flush()  # a round trip to the server: anything it echoed has arrived by now
    assert nc.stats["in_msgs"] == received


def _sent(app: PickerApp) -> tuple[float, float]:
    m = sync(app).metrics
    return m.batches_sent.labels("nats")._value.get(), m.changes_sent.labels("nats")._value.get()


async def test_changes_made_within_the_linger_go_to_the_peers_in_one_message(replicas) -> None:
    a, b = await replicas(2, replica_sync_linger_ms=300)
    before = _sent(a)
    booking = a.load.book(WORKER, 4)
    await asyncio.sleep(0.05)
    assert _sent(a) == before and b.load.load(WORKER).inflight == 0  # still held at A
    booking.free()
    await until_async(lambda: _sent(a) != before, "the batch sent")
    batches, changes = _sent(a)
    assert (batches - before[0], changes - before[1]) == (1, 2)  # booking and free together
    assert b.load.load(WORKER).inflight == 0


async def test_without_a_linger_each_change_is_sent_at_once(replicas) -> None:
    a, b = await replicas(2)
    before = _sent(a)
    booking = a.load.book(WORKER, 4)
    await until_async(lambda: b.load.load(WORKER).inflight == 1, "the booking at B")
    booking.free()
    await until_async(lambda: b.load.load(WORKER).inflight == 0, "the free at B")
    assert _sent(a)[0] - before[0] == 2
