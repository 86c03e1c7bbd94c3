"""Replicas that act as one picker: bookings and predictions shared over the real ReplicaSync gRPC service.

Pickers run in-process (so their load views can be read directly) except where a test needs a real process
death; the network between them is real gRPC over loopback, and a partition is a real TCP proxy that stops
forwarding without closing anything (what a dropped route looks like).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from epp_extproc.adapters.worker_facts import Prompt
from epp_extproc.app import PickerApp
from epp_extproc.config import Config, ProcessSlot
from tests.netutil import free_port
from tests.waiting import until_async

WORKER = "127.0.0.1:1"  # bookings name a worker address; nothing needs to listen there
FAST = {"peer_timeout_ms": 1500, "peer_expiry_ms": 500}  # generous: the test machine is shared


def config(sync_port: int, peers: list[int], **extra: object) -> Config:
    """A replica pushing to `peers` (see `replica` for one that only receives)."""
    cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1", endpoints=f"w={WORKER}",
                 endpoint_probe_interval_ms=0, replica_sync_port=sync_port, secure_serving=False,
                 peers=",".join(f"127.0.0.1:{p}" for p in peers), **{**FAST, **extra})  # type: ignore[arg-type]
    cfg.validate()
    return cfg


def replica(sync_port: int, peers: list[int], **extra: object) -> PickerApp:
    """A picker app; with no peers it only receives (its sync service still listens)."""
    slot = ProcessSlot(sync_listen=() if peers else (f"127.0.0.1:{sync_port}",))
    return PickerApp(config(sync_port, peers, **extra), slot)


@pytest.fixture
async def mesh() -> AsyncIterator[Callable[..., Awaitable[list[PickerApp]]]]:
    """`await mesh(n)`: n replicas, each listing every other one as a peer, all synced."""
    apps: list[PickerApp] = []

    async def make(n: int, **extra: object) -> list[PickerApp]:
        ports = [free_port() for _ in range(n)]
        return await started(apps, [replica(p, [q for q in ports if q != p], **extra) for p in ports])

    yield make
    for a in apps:
        await a.stop(0)


async def started(apps: list[PickerApp], new: list[PickerApp]) -> list[PickerApp]:
    """Start `new` (each kept in `apps` for the teardown) and wait until every replica is ready and every
    link up."""
    for a in new:
        await a.start()
        apps.append(a)
    await until_async(lambda: all(a.ready() and all(lk.up for lk in a.sync.links.values()) for a in new),
                      "every link up")  # type: ignore[union-attr]
    return new


def inflight(app: PickerApp) -> int:
    return app.load.load(WORKER).inflight


async def test_a_booking_on_one_replica_is_load_on_the_other(mesh) -> None:  # noqa: ANN001
    a, b = await mesh(2)
    booking = a.load.book(WORKER, 10)
    await until_async(lambda: b.load.load(WORKER).prefill_blocks == 10 and inflight(b) == 1, "the booking at B")
    booking.prefill_done()
    await until_async(lambda: b.load.load(WORKER).prefill_blocks == 0, "prefill done at B")
    assert b.load.load(WORKER).decode_blocks == 10
    booking.move("127.0.0.1:2")
    await until_async(lambda: b.load.load("127.0.0.1:2").inflight == 1 and inflight(b) == 0, "the move at B")
    booking.free()
    await until_async(lambda: b.load.load("127.0.0.1:2").inflight == 0, "the free at B")
    assert b.load.peer_inflight() == 0 and b.load.total_inflight() == 0


def sent(app: PickerApp) -> tuple[float, float]:
    """Batches and changes this replica has pushed, over every peer."""
    m = app.sync.metrics  # type: ignore[union-attr]
    return (sum(s.value for f in m.batches_sent.collect() for s in f.samples if s.name.endswith("_total")),
            sum(s.value for f in m.changes_sent.collect() for s in f.samples if s.name.endswith("_total")))


async def test_changes_made_within_the_linger_reach_a_peer_in_one_batch(mesh) -> None:  # noqa: ANN001
    a, b = await mesh(2, replica_sync_linger_ms=300)
    before = sent(a)
    booking = a.load.book(WORKER, 4)
    await asyncio.sleep(0.05)
    assert sent(a) == before and inflight(b) == 0  # still held at A
    booking.free()
    await until_async(lambda: sent(a) != before, "the batch sent")
    assert (sent(a)[0] - before[0], sent(a)[1] - before[1]) == (1, 2)  # booking and free together
    assert inflight(b) == 0


async def test_a_first_chunk_seen_by_another_replica_ends_the_prefill_where_it_was_booked(mesh) -> None:  # noqa: ANN001
    """Lean mode: Envoy round-robins the observer stream on its own, so a request's first chunk is reported to
    another replica than the one that booked it. B hands it to A over the sync; A ends the booking's prefill
    (and says so to C). Before, A and C counted the prompt as prefilling until the request ended."""
    a, b, c = await mesh(3)
    booking = a.load.book(WORKER, 10)
    await until_async(lambda: all(x.load.load(WORKER).prefill_blocks == 10 for x in (b, c)), "the booking at B, C")
    b.picker.first_chunk(booking.id)
    await until_async(lambda: not booking.prefilling, "prefill done at A")
    await until_async(lambda: all(x.load.load(WORKER).prefill_blocks == 0 for x in (a, b, c)), "prefill 0 at A, B, C")
    assert all(x.load.load(WORKER).decode_blocks == 10 for x in (a, b, c))
    assert b.metrics.lean_signals.labels("first_chunk_forwarded")._value.get() == 1


async def test_three_replicas_each_see_the_sum_of_all_bookings(mesh) -> None:  # noqa: ANN001
    apps = await mesh(3)
    held = [app.load.book(WORKER, 1) for app in apps for _ in range(2)]
    await until_async(lambda: all(inflight(app) == 6 for app in apps), "6 bookings everywhere")
    for b in held[:3]:
        b.free()
    await until_async(lambda: all(inflight(app) == 3 for app in apps), "3 bookings everywhere")
    assert [app.load.total_inflight() for app in apps] == [0, 1, 2]  # each still owns only its own


async def test_a_prediction_on_one_replica_counts_as_cached_on_the_other(mesh) -> None:  # noqa: ANN001
    a, b = await mesh(2, tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1",
                      prediction_ttl_s=5.0)
    prompt = Prompt(list(range(32 * 4 + 1)), None)
    assert b.kv is not None and a.kv is not None
    assert b.kv.overlap(prompt, [WORKER]).get(WORKER, 0) == 0
    a.kv.predict(WORKER, prompt)
    await until_async(lambda: b.kv.overlap(prompt, [WORKER]).get(WORKER, 0) == 4, "the predicted blocks at B")


async def test_a_restarted_receiver_gets_the_bookings_back_from_a_snapshot(mesh) -> None:  # noqa: ANN001
    a, b = await mesh(2)
    held = [a.load.book(WORKER, 2) for _ in range(3)]
    await until_async(lambda: inflight(b) == 3, "3 bookings at B")
    port = b.config.replica_sync_port
    await b.stop(0)
    b2 = replica(port, [])
    await b2.start()
    try:
        await until_async(lambda: inflight(b2) == 3, "the snapshot at the restarted B")
        held[0].free()
        await until_async(lambda: inflight(b2) == 2, "deltas after the snapshot")
    finally:
        await b2.stop(0)


async def test_a_restarted_sender_replaces_its_old_bookings_at_once(mesh) -> None:  # noqa: ANN001
    b_port = free_port()
    b = replica(b_port, [], peer_expiry_ms=60_000)  # expiry far away: only the snapshot can act
    await b.start()
    a_cfg = config(free_port(), [b_port])
    a = PickerApp(a_cfg)
    a.sync.replica_id = "replica-a"  # type: ignore[union-attr]  # the stable POD_NAME a restart keeps
    await a.start()
    try:
        for _ in range(3):
            a.load.book(WORKER, 1)
        await until_async(lambda: inflight(b) == 3, "3 bookings at B")
        await a.stop(0)  # no frees: the process is gone with its bookings
        a2 = PickerApp(a_cfg)
        a2.sync.replica_id = "replica-a"  # type: ignore[union-attr]
        await a2.start()
        a2.load.book(WORKER, 1)
        await until_async(lambda: inflight(b) == 1, "the new incarnation's snapshot replacing the old bookings")
        await a2.stop(0)
    finally:
        await b.stop(0)


# ------------------------------------------------------------------------------------- a peer killed

PEER_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from epp_extproc.app import PickerApp
    from epp_extproc.config import Config, ProcessSlot

    async def main() -> None:
        cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1", endpoints="w=127.0.0.1:1",
                     endpoint_probe_interval_ms=0, replica_sync_port=0, peers=sys.argv[1],
                     peer_timeout_ms=1500, peer_expiry_ms=500)
        app = PickerApp(cfg)
        await app.start()
        held = [app.load.book("127.0.0.1:1", 4) for _ in range(int(sys.argv[2]))]
        print("booked", len(held), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


async def test_a_killed_peer_has_its_bookings_expire(mesh) -> None:  # noqa: ANN001
    b_port = free_port()
    b = replica(b_port, [])
    await b.start()
    peer = subprocess.Popen([sys.executable, "-c", PEER_SCRIPT, f"127.0.0.1:{b_port}", "5"],
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        await until_async(lambda: inflight(b) == 5, "the peer's 5 bookings at B", timeout=20)
        mine = b.load.book(WORKER, 1)
        os.kill(peer.pid, signal.SIGKILL)  # mid-load: nothing is freed, nothing says goodbye
        peer.wait(10)
        await until_async(lambda: inflight(b) == 1, "the dead peer's bookings expiring")
        assert b.load.peer_inflight() == 0 and b.load.peers() == []
        assert b.sync is not None and b.sync.metrics.bookings_expired._value.get() == 5
        mine.free()
        assert inflight(b) == 0 and b.load.load(WORKER).decode_blocks == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        await b.stop(0)


# ------------------------------------------------------------------------------------- partition

class Blackhole:
    """A TCP proxy that can stop forwarding in both directions while keeping every connection open."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.cut = False
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> Blackhole:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                if not self.cut:
                    w.write(data)
                    await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            w.close()
            return
        self._writers += [w, uw]
        await asyncio.gather(self._pipe(r, uw), self._pipe(ur, w))

    async def close(self) -> None:
        for w in self._writers:
            w.close()
        if self._server is not None:
            self._server.close()


async def test_a_partition_expires_the_peer_and_healing_resyncs_it() -> None:
    b_port = free_port()
    b = replica(b_port, [])
    await b.start()
    proxy = await Blackhole(b_port).start()
    a = replica(free_port(), [proxy.port])
    await a.start()
    try:
        held = [a.load.book(WORKER, 1) for _ in range(3)]
        await until_async(lambda: inflight(b) == 3, "3 bookings at B")
        proxy.cut = True
        await until_async(lambda: inflight(b) == 0, "B dropping the unreachable peer's bookings")
        held[0].free()
        held += [a.load.book(WORKER, 1) for _ in range(2)]  # A now holds 4, B cannot know yet
        await asyncio.sleep(0.2)
        assert inflight(b) == 0
        proxy.cut = False
        await until_async(lambda: inflight(b) == 4, "the snapshot after the heal")
        assert b.load.peer_inflight() == 4
    finally:
        await a.stop(0)
        await proxy.close()
        await b.stop(0)


# ------------------------------------------------------------------------------------- readiness, drain

async def test_a_replica_is_not_ready_until_it_has_synced_with_a_reachable_peer() -> None:
    b_port = free_port()
    b = replica(b_port, [])
    await b.start()
    proxy = await Blackhole(b_port).start()
    proxy.cut = True  # reachable (the connection opens) but nothing answers yet
    a = replica(free_port(), [proxy.port])
    await a.start()
    try:
        await asyncio.sleep(0.2)
        assert not a.ready()
        proxy.cut = False
        await until_async(a.ready, "readiness once the peer answered")  # after a retry through the healed path
    finally:
        await a.stop(0)
        await proxy.close()
        await b.stop(0)


async def test_stopping_flushes_the_last_frees_to_the_peers(mesh) -> None:  # noqa: ANN001
    a, b = await mesh(2, peer_expiry_ms=60_000)  # expiry far away: only A's own frees can clear B's view
    held = [a.load.book(WORKER, 1) for _ in range(2)]
    await until_async(lambda: inflight(b) == 2, "2 bookings at B")
    for h in held:
        h.free()  # the last streams ending as the drain completes; stop() follows at once
    await a.stop(0.5)
    await until_async(lambda: inflight(b) == 0, "the frees at B")
    assert not a.ready()
