"""The KV event plane on a real nats-server: real ZeroMQ publishers -> `Relay` -> NATS -> the picker's
`PlaneSubscribers`, with the faults of issue 47 (NATS stopped, restarted, partitioned; a relay restarted; a
lost message; malformed messages and dumps). One behaviour per test."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from nats.aio.client import Client

from epp_extproc.dev.kvwire import stored_event
from epp_extproc.dev.nats import NatsServer
from epp_extproc.kvplane.follower import PlaneSubscribers
from epp_extproc.kvplane.relay import Relay
from epp_extproc.kvplane.wire import KIND_BATCH, Subjects, encode_live, parse_live
from kvindex.index import KvIndex
from kvindex.subscriber import KvSource, SubscriberManager
from tests.integration.test_kvindex_subscriber import FakeWorker
from tests.natsutil import nats_server  # noqa: F401  (fixture)
from tests.waiting import SCALE, until_async

BS = 4
W = "10.0.0.7:8000"  # a worker id with the dots and colon an address has


def block(i: int) -> list[int]:
    return list(range(1 + i * BS, 1 + (i + 1) * BS))


def prompt(n: int) -> list[int]:
    return [t for i in range(n) for t in block(i)] + [0]


class Plane:
    """One worker (a real ZeroMQ PUB), a relay, and a picker's plane subscriber with its ZeroMQ fallback."""

    def __init__(self, ctx: Any, server: NatsServer, **picker_kw: Any) -> None:
        self.ctx = ctx
        self.server = server
        self.subjects = Subjects("epp.kv", "t")
        self.worker = FakeWorker(ctx)
        self.sources = [KvSource(self.worker.endpoint)]
        self.relay: Relay | None = None
        self.idx = KvIndex(default_block_size=BS)
        self.fallback = SubscriberManager(self.idx, zmq_context=ctx)
        kw = {"dump_timeout_s": 1.0, "relay_stale_s": 3.0, **picker_kw}
        self.picker = PlaneSubscribers(self.idx, self.fallback, [server.url], self.subjects, **kw)
        self.n = 0

    async def start_relay(self, **kw: Any) -> Relay:
        self.relay = Relay([self.server.url], self.subjects, {W: self.sources}, block_size=BS,
                           heartbeat_s=0.2, **kw)
        await self.relay.start()
        await until_async(lambda: self.relay is not None and self.relay.link.connected, "relay connected")
        await self.worker.sync(self.relay.subs, W)
        return self.relay

    async def stop_relay(self) -> None:
        if self.relay is not None:
            await self.relay.close()
            self.relay = None

    async def store(self) -> int:
        """The next block of the worker's one chain; returns the chain's length."""
        parent = self.n if self.n else None
        self.n += 1
        await self.worker.publish([stored_event([self.n], parent, block(self.n - 1), BS)])
        return self.n

    def overlap(self) -> int:
        return self.idx.overlap(prompt(self.n), exclude_last_token=False).get(W, 0)

    async def until_overlap(self, n: int, what: str = "the picker's index to reach the chain") -> None:
        await until_async(lambda: self.overlap() == n, lambda: f"{what}: overlap {self.overlap()} != {n}, "
                          f"{self.picker.stats(W)}")

    def stats(self):
        return self.picker.stats(W)

    async def close(self) -> None:
        await self.picker.close()
        await self.stop_relay()
        self.worker.close()


@pytest.fixture
async def plane(ctx, nats_server) -> AsyncIterator[Callable[..., Plane]]:  # noqa: F811
    made: list[Plane] = []

    def make(**kw: Any) -> Plane:
        p = Plane(ctx, nats_server, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        await p.close()


async def live_with_one_block(p: Plane) -> Plane:
    """The relay up, the picker live on the plane, one block stored and seen."""
    await p.start_relay()
    await p.picker.add(W, p.sources)
    await p.store()
    await p.until_overlap(1)
    await until_async(lambda: p.stats().mode == "live")
    return p


async def raw_client(server: NatsServer) -> Client:
    nc = Client()
    await nc.connect(server.url)
    return nc


async def test_relay_publishes_each_batch_on_the_workers_subject_with_seq_and_identity(plane, nats_server):  # noqa: F811
    p = plane()
    await p.start_relay()
    nc = await raw_client(nats_server)
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on(m: Any) -> None:
        got.put_nowait(m.data)

    await nc.subscribe(p.subjects.events(W), cb=on)
    await nc.flush()
    await p.store()
    s1 = p.worker.seq
    await p.store()
    s2 = p.worker.seq
    seen = {}
    while len(seen) < 2:  # (a heartbeat of the sync before the subscription may still come first)
        m = parse_live(await asyncio.wait_for(got.get(), 20 * SCALE), 1 << 20)
        assert m is not None
        if m.engine_seq in (s1, s2):
            seen[m.engine_seq] = m
    first, second = seen[s1], seen[s2]
    assert (first.worker_id, first.kind, second.seq - first.seq) == (W, KIND_BATCH, 1)
    assert first.epoch == second.epoch == p.relay.epoch
    await nc.close()


async def test_a_relays_dump_says_where_its_history_begins_and_begins_again_after_a_clear(plane):
    from epp_extproc.kvplane.wire import parse_dump_chunk

    p = plane()
    relay = await p.start_relay()
    begins = relay.subs.first_seqs[W][None]
    await p.store()
    await until_async(lambda: relay.subs.engine_seqs[W][None] == p.worker.seq, "the relay to apply the store")
    chunk = parse_dump_chunk(relay.dump(W, 1 << 20)[0], 1 << 20)
    assert chunk.first_seqs == {None: begins} and chunk.engine_seqs == {None: p.worker.seq} and begins < p.worker.seq
    p.worker.seq = 0  # the engine restarted: the relay clears the worker, its history begins again
    await p.store()
    await until_async(lambda: relay.subs.first_seqs[W].get(None) == 1, "the relay's clear and first batch")
    assert parse_dump_chunk(relay.dump(W, 1 << 20)[0], 1 << 20).first_seqs == {None: 1}


@pytest.mark.parametrize("direct_dispatch", [True, False], ids=["direct", "nats-py-queue"])
async def test_picker_follows_the_live_stream_into_the_same_index(plane, direct_dispatch):
    p = plane(direct_dispatch=direct_dispatch)
    await p.start_relay()
    await p.picker.add(W, p.sources)
    await until_async(lambda: p.stats().mode == "live", "the first dump")
    for _ in range(3):
        await p.store()
    await p.until_overlap(3)
    assert p.idx.engine_hashes(W) == p.relay.idx.engine_hashes(W) == {1, 2, 3}
    assert p.stats().fallback is False and p.fallback.workers() == []


async def test_a_picker_started_late_gets_the_blocks_from_the_dump_without_engine_replay(plane):
    p = plane()
    await p.start_relay()
    for _ in range(4):
        await p.store()
    await until_async(lambda: p.relay.idx.blocks_indexed(W) == 4)
    assert p.worker.replay_endpoint is None  # the engine offers no replay at all
    await p.picker.add(W, p.sources)
    await p.until_overlap(4)
    assert p.stats().dumps == 1 and p.stats().dump_blocks == 4


async def test_a_dump_larger_than_the_servers_max_payload_comes_in_chunks(ctx):
    server = NatsServer(max_payload=8192)
    await server.start()
    p = Plane(ctx, server)
    try:
        await p.start_relay()
        n = 2000  # 2000 pairs x 16 bytes: four chunks of 8 KB
        await p.worker.publish([stored_event(list(range(1, n + 1)), None, list(range(n * BS)), BS)])
        await until_async(lambda: p.relay.idx.blocks_indexed(W) == n)
        assert len(p.relay.dump(W, 8192)) > 1
        await p.picker.add(W, p.sources)
        await until_async(lambda: p.idx.blocks_indexed(W) == n, "the chunked dump")
        assert p.idx.overlap(list(range(n * BS)), exclude_last_token=False) == {W: n}
    finally:
        await p.close()
        await server.stop()


async def test_a_lost_plane_message_is_a_gap_answered_by_a_dump(plane):
    p = plane()
    relay = await p.start_relay()
    await p.picker.add(W, p.sources)
    await until_async(lambda: p.stats().mode == "live")
    await p.store()
    await p.until_overlap(1)
    relay.outbox_messages = 0  # the relay's next message is dropped (its outbox full): the sequence jumps
    await p.store()
    await until_async(lambda: relay.dropped == 1)
    relay.outbox_messages = 100
    await p.store()
    await p.until_overlap(3, "recovery from the gap")
    assert p.stats().gaps == 1 and p.stats().dumps == 2 and p.stats().dumps_merged == 0  # the same relay's dump


async def test_a_lost_tail_is_seen_in_the_relays_heartbeat(plane):
    p = plane()
    relay = await p.start_relay()
    await p.picker.add(W, p.sources)
    await until_async(lambda: p.stats().mode == "live")
    relay.outbox_messages = 0  # the last message before a quiet time is dropped: only the heartbeat can tell
    await p.store()
    await until_async(lambda: relay.dropped == 1)
    relay.outbox_messages = 100
    await p.until_overlap(1, "the heartbeat to show the lost tail")
    assert p.stats().gaps == 1


async def test_a_relay_restart_carries_the_pickers_entries_when_the_engines_numbering_continues(plane):
    p = await live_with_one_block(plane())
    old_epoch = p.relay.epoch
    await p.stop_relay()
    await p.start_relay()  # no engine replay: the new relay knows nothing of block 1
    assert p.relay.epoch != old_epoch
    await p.store()  # block 2, a child of block 1: only the picker still knows its parent
    await p.until_overlap(2, "the new relay's stream on top of what the picker held")
    s = p.stats()
    assert (s.relay_restarts, s.carried, s.carry_cleared, s.dumps, s.epoch) == (1, 1, 0, 1, p.relay.epoch)


async def test_engine_batches_nobody_relayed_during_a_carried_restart_are_counted(plane):
    p = await live_with_one_block(plane())
    await p.stop_relay()
    await p.store()  # block 2, published while no relay listens: lost
    await p.start_relay()
    await p.store()  # block 3: its parent (2) is unknown to the picker, block 1 stays credited
    await until_async(lambda: p.stats().carried == 1 and p.stats().seq and p.stats().carried_missed >= 1)
    assert p.overlap() == 1 and p.stats().carry_cleared == 0


async def test_a_carried_restart_clears_what_an_engine_restarted_meanwhile_no_longer_holds(plane):
    p = await live_with_one_block(plane())
    await p.stop_relay()
    p.worker.seq = 0  # the engine restarted too: its numbering starts again
    await p.start_relay()
    await until_async(lambda: p.stats().carry_cleared == 1, "the new stream's first message checked")
    assert p.overlap() == 0 and p.stats().carried == 1


async def test_a_new_relays_dump_after_its_first_message_was_lost_goes_on_top_of_what_the_picker_held(plane):
    p = await live_with_one_block(plane())
    await p.stop_relay()
    relay = await p.start_relay(outbox_messages=0)  # its first messages are dropped: the picker sees none
    relay.outbox_messages = 100
    await p.worker.publish([stored_event([50], None, block(9), BS)])  # a new prompt: only the new relay knows it
    await until_async(lambda: p.stats().dumps == 2, "the new relay's dump")
    assert p.overlap() == 1, "block 1, which the new relay never saw, is kept"
    assert p.idx.overlap(block(9) + [0], exclude_last_token=False).get(W) == 1, "the dump's block is loaded"
    await p.store()  # block 2, a child of block 1: the new relay cannot chain it, the picker can
    await p.until_overlap(2, "the new relay's stream on top of both")
    s = p.stats()
    assert (s.carried, s.dumps, s.dumps_merged, s.epoch) == (0, 2, 1, relay.epoch) and s.relay_restarts >= 1


async def test_a_new_relays_dump_replaces_the_entries_when_the_engine_restarted_meanwhile(plane):
    p = await live_with_one_block(plane())
    await p.stop_relay()
    p.worker.seq = 0  # the engine restarted: block 1 is gone and its numbering starts again
    relay = await p.start_relay(outbox_messages=0)  # and the new relay's first messages are lost
    relay.outbox_messages = 100
    await p.worker.publish([stored_event([50], None, block(9), BS)])  # another block of the new engine
    await until_async(lambda: p.stats().dumps == 2, "the new relay's dump")
    assert p.overlap() == 0 and p.stats().dumps_merged == 0


async def test_a_worker_on_its_direct_events_rejoins_a_new_relays_stream_carrying_what_they_built(plane):
    p = await live_with_one_block(plane())
    await p.stop_relay()  # silent past relay_stale_s: the worker falls back to its own ZeroMQ events
    await until_async(lambda: p.stats().fallback and W in p.fallback.workers(), "the fallback")
    await p.worker.sync(p.fallback, W)
    await p.store()  # block 2: only the direct subscription sees it
    await p.until_overlap(2)
    await p.start_relay()  # a new relay that knows neither block
    await p.store()  # block 3
    await p.until_overlap(3, "the new relay's stream on top of what the direct events built")
    s = p.stats()
    assert (s.mode, s.fallback, s.carried, s.dumps, s.recoveries) == ("live", False, 1, 1, 1)
    assert W not in p.fallback.workers()


async def test_a_worker_retrying_its_first_dump_on_its_direct_events_rejoins_a_relays_first_stream(plane, nats_server):  # noqa: F811
    """A picker started before any relay: its dump fails and is retried, the worker fed by its own events;
    the relay's first message carries what those built, where a retried dump would have replaced it."""
    from epp_extproc.dev.kvwire import pack_batch

    p = plane(dump_timeout_s=0.5)
    await p.picker.add(W, p.sources)  # nobody serves the dump subject: "no responders", the fallback
    await until_async(lambda: p.stats().fallback and W in p.fallback.workers(), "the fallback")
    await p.worker.sync(p.fallback, W)
    await p.store()  # block 1, through the direct subscription
    await p.until_overlap(1)
    nc = await raw_client(nats_server)  # a hand-made relay: its first live message, block 2 after block 1
    batch = pack_batch([stored_event([2], 1, block(1), BS)])
    await nc.publish(p.subjects.events(W), encode_live(KIND_BATCH, None, 7, 1, p.worker.seq + 1, W, batch))
    await nc.flush()
    p.n = 2
    await p.until_overlap(2, "the relay's first message on top of the direct events' blocks")
    s = p.stats()
    assert (s.mode, s.fallback, s.carried, s.dumps, s.carried_missed) == ("live", False, 1, 0, 0)
    await nc.close()


async def test_a_retried_first_dump_answered_by_a_relay_goes_on_top_of_what_the_direct_events_built(plane):
    """A picker started before any relay is fed by its direct events; the relay's first messages are lost, so
    its dump, not its stream, brings the worker onto the plane: it keeps the direct events' blocks."""
    p = plane(dump_timeout_s=0.5)
    await p.picker.add(W, p.sources)  # nobody serves the dump subject: "no responders", the fallback
    await until_async(lambda: p.stats().fallback and W in p.fallback.workers(), "the fallback")
    await p.worker.sync(p.fallback, W)
    await p.store()  # block 1, through the direct subscription only
    await p.until_overlap(1)
    relay = await p.start_relay(outbox_messages=0)
    relay.outbox_messages = 100
    await p.store()  # block 2: the relay cannot chain it (it never saw block 1), the direct events do
    await until_async(lambda: not p.stats().fallback, "back on the plane by the relay's dump")
    assert p.overlap() == 2, "the direct events' blocks are kept"
    s = p.stats()
    assert (s.mode, s.dumps, s.dumps_merged, s.carried) == ("live", 1, 1, 0)
    assert W not in p.fallback.workers()


async def second_relay(p: Plane) -> Relay:
    """Another relay for the same worker beside ``p.relay`` (a pool relay's rolling update, or a mistake)."""
    r = Relay([p.server.url], p.subjects, {W: p.sources}, block_size=BS, heartbeat_s=0.2)
    await r.start()
    await until_async(lambda: r.link.connected, "the second relay connected")
    await p.worker.sync(r.subs, W)
    return r


async def crash(r: Relay) -> None:
    """Stop a relay without its goodbye, as a killed process."""
    async def silent() -> None:
        return None

    r._goodbye = silent  # type: ignore[method-assign]
    await r.close()


async def test_a_second_relay_for_a_worker_is_handed_over_to_not_followed_from_dump_to_dump(plane):
    p = await live_with_one_block(plane())
    r2 = await second_relay(p)
    try:
        for _ in range(5):
            await p.store()
            await asyncio.sleep(0.1)
        await p.until_overlap(6, "the followed relay's stream")
        await asyncio.sleep(0.5)  # a few heartbeats of both
        s = p.stats()
        assert s.other_relay > 0 and s.dumps == 1 and s.carry_cleared == 0 and p.overlap() == 6
        assert (s.epoch, s.relay_restarts) == (r2.epoch, 1), "handed over at the new relay's first message"
        await p.stop_relay()  # a rolling update ends: the old relay goes
        await p.store()
        await p.until_overlap(7, "the new relay's stream")
    finally:
        await r2.close()


async def test_the_second_relays_stream_is_followed_once_the_first_one_crashed(plane):
    p = await live_with_one_block(plane(relay_stale_s=1.0))
    r2 = await second_relay(p)
    try:
        await p.store()
        await p.until_overlap(2)
        followed = p.stats().epoch
        other = r2 if followed == p.relay.epoch else p.relay
        await crash(p.relay if other is r2 else r2)
        await asyncio.sleep(1.2)  # the crashed relay silent past relay_stale_s
        await p.store()
        await until_async(lambda: p.stats().epoch == other.epoch and p.overlap() == 3, lambda: f"{p.stats()}")
    finally:
        await r2.close()


async def test_a_followed_relay_that_delivers_nothing_a_second_one_publishes_is_left_for_it(plane):
    """Its process is alive (heartbeats) but its subscription to the worker is not: after relay_stale_s of
    the second relay's batches alone, the worker follows the second relay."""
    p = await live_with_one_block(plane(relay_stale_s=1.0))
    r2 = await second_relay(p)
    try:
        await p.store()
        await p.until_overlap(2)
        followed = p.relay if p.stats().epoch == p.relay.epoch else r2
        other = r2 if followed is p.relay else p.relay
        await followed.subs.remove(W)  # it stops reading the worker, and keeps sending heartbeats
        p.n = 0  # new chains from here
        for _ in range(12):  # ~1.2 s of the other relay's batches
            await p.store()
            await asyncio.sleep(0.1)
        await until_async(lambda: p.stats().epoch == other.epoch, lambda: f"the switch: {p.stats()}")
        p.n = 100
        await p.worker.publish([stored_event([5000], None, block(100), BS)])  # a new prompt after the switch
        await until_async(lambda: p.idx.overlap(block(100) + [0], exclude_last_token=False).get(W) == 1,
                          "the new relay's stream applied")
        assert p.stats().carried_missed > 0 and p.stats().other_relay > 0
    finally:
        await r2.close()


async def test_a_picker_joining_several_relays_of_one_worker_takes_one_whole_dump_and_refuses_nothing(
        plane, nats_server):  # noqa: F811
    """Relays answer the dump request; their chunks interleave (here from one hand-made responder, in a fixed
    order): the first whole dump is loaded, the other relays' chunks are counted, nothing is refused."""
    from epp_extproc.kvplane.wire import DumpChunk, DumpSlot, encode_dump_chunk

    p = plane()
    nc = await raw_client(nats_server)

    def chunks(epoch: int, hashes: list[int]) -> list[bytes]:
        return [encode_dump_chunk(DumpChunk(W, epoch, 5, i, len(hashes), BS, "events",
                                            [DumpSlot(0, BS, array("Q", [h]).tobytes(),
                                                      array("Q", [h + 1000]).tobytes())]))
                for i, h in enumerate(hashes)]

    async def answer(m: Any) -> None:
        a, b, x = chunks(1, [11, 12]), chunks(2, [21, 22, 23]), chunks(3, [31, 32])
        for data in (b[0], a[0], x[0], b[1], a[1], b[2]):  # relay 1's dump completes first; a third is ignored
            await nc.publish(m.reply, data)

    await nc.subscribe(p.subjects.dump(W), cb=answer)
    await nc.flush()
    await p.picker.add(W, p.sources)
    await until_async(lambda: p.stats().mode == "live", lambda: f"one relay's dump: {p.stats()}")
    s = p.stats()
    assert (s.epoch, s.dumps, s.dump_blocks, s.dumps_refused, s.garbage, s.fallback) == (1, 1, 2, 0, 0, False)
    assert s.other_relay == 3  # relay 2's two chunks and relay 3's one that came before relay 1's dump was whole
    await nc.close()


async def test_a_stopping_relay_says_goodbye_and_a_crashed_one_does_not(plane, nats_server):  # noqa: F811
    from epp_extproc.kvplane.wire import parse_heartbeat

    p = plane()
    nc = await raw_client(nats_server)
    got: list[Any] = []

    async def on(m: Any) -> None:
        hb = parse_heartbeat(m.data, 1 << 20)
        if hb is not None and hb.bye:
            got.append(hb)

    await nc.subscribe(p.subjects.heartbeat, cb=on)
    await nc.flush()
    relay = await p.start_relay()
    await crash(relay)
    relay = await p.start_relay()
    await p.stop_relay()
    await until_async(lambda: len(got) == 1, "the goodbye")
    assert (got[0].epoch, got[0].workers.get(W, -1) >= 0) == (relay.epoch, True)
    await nc.close()


async def test_a_relay_keeps_what_it_read_before_its_first_connect_and_publishes_it_once_up(plane, nats_server):  # noqa: F811
    """So that a restarted relay's stream reaches the pickers from its first message (they carry what they
    hold rather than ask for this relay's partial dump)."""
    p = plane()
    await nats_server.stop()
    p.relay = Relay([nats_server.url], p.subjects, {W: p.sources}, block_size=BS, heartbeat_s=0.2)
    await p.relay.start()
    await p.worker.sync(p.relay.subs, W)  # applied while NATS is down
    await p.store()
    await until_async(lambda: p.relay.idx.blocks_indexed(W) == 1)
    emitted = p.relay.seq[W]
    await nats_server.start()
    await until_async(lambda: p.relay.published >= emitted, "the queued messages published")
    assert p.relay.dropped == 0


async def test_what_a_relay_queues_before_its_first_connect_is_bounded_in_bytes(plane, nats_server):  # noqa: F811
    p = plane()
    await nats_server.stop()
    p.relay = Relay([nats_server.url], p.subjects, {W: p.sources}, block_size=BS, heartbeat_s=0.2,
                    outbox_bytes=300)  # room for about two small batches
    await p.relay.start()
    await p.worker.sync(p.relay.subs, W)
    for _ in range(5):
        await p.store()
    await until_async(lambda: p.relay.idx.blocks_indexed(W) == 5)
    assert p.relay.dropped >= 3 and p.relay.queued_bytes <= 300


async def test_nats_stopped_falls_back_to_direct_zmq_and_recovers_when_it_returns(plane, nats_server):  # noqa: F811
    p = await live_with_one_block(plane())  # (a picker starts on ZeroMQ until its first connect)
    fallbacks, recoveries = p.stats().fallbacks, p.stats().recoveries
    await nats_server.stop()
    await until_async(lambda: p.stats().fallback and W in p.fallback.workers(), "the fallback")
    await p.worker.sync(p.fallback, W)
    await p.store()  # only the direct ZeroMQ subscription can see this one
    await p.until_overlap(2, "the fallback's direct events")
    await nats_server.start()
    await until_async(lambda: not p.stats().fallback and p.stats().mode == "live", "the recovery", timeout=20)
    assert p.fallback.workers() == []
    assert (p.stats().fallbacks - fallbacks, p.stats().recoveries - recoveries) == (1, 1)
    await p.worker.sync(p.relay.subs, W)
    await p.store()
    await p.until_overlap(3, "the plane after the recovery")


async def test_load_fallback_drops_the_workers_entries_until_the_plane_returns(plane, nats_server):  # noqa: F811
    p = plane(fallback_mode="load")
    await p.start_relay()
    await p.picker.add(W, p.sources)
    await p.store()
    await p.until_overlap(1)
    await nats_server.stop()
    await until_async(lambda: p.stats().fallback and p.idx.blocks_indexed(W) == 0, "load-only fallback")
    assert p.fallback.workers() == []
    await nats_server.start()
    await p.until_overlap(1, "the dump after NATS is back")


async def test_a_partitioned_server_is_noticed_and_the_worker_falls_back(plane, nats_server):  # noqa: F811
    p = await live_with_one_block(plane())
    recoveries = p.stats().recoveries
    await nats_server.pause()  # the sockets stay open, nothing is answered: a partition
    await until_async(lambda: p.stats().fallback, "the fallback after a silent server", timeout=15)
    await nats_server.resume()
    await until_async(lambda: not p.stats().fallback and p.stats().mode == "live", "the recovery", timeout=20)
    assert p.stats().recoveries == recoveries + 1


async def test_a_malformed_message_on_a_workers_subject_is_refused_and_counted(plane, nats_server):  # noqa: F811
    p = plane()
    await p.start_relay()
    await p.picker.add(W, p.sources)
    await p.store()
    await p.until_overlap(1)
    nc = await raw_client(nats_server)
    await nc.publish(p.subjects.events(W), b"KVP1 not a header")
    # a well-formed message that names another worker than its subject does: refused too
    await nc.publish(p.subjects.events(W), encode_live(KIND_BATCH, 0, p.relay.epoch, 99, 1, "someone-else", b"\x90"))
    await nc.flush()
    await until_async(lambda: p.stats().garbage == 2)
    assert p.idx.stats(W).garbage_frames == 2
    await p.store()
    await p.until_overlap(2, "the stream after the refused messages")
    assert p.stats().gaps == 0
    await nc.close()


async def test_a_malformed_dump_is_refused_and_the_worker_stays_on_the_fallback(plane, nats_server):  # noqa: F811
    p = plane()
    nc = await raw_client(nats_server)

    async def bad_relay(msg: Any) -> None:
        await nc.publish(msg.reply, b"KVD1\x81\xa1v\x01")  # a version-1 map and nothing else

    await nc.subscribe(p.subjects.dump(W), cb=bad_relay)
    await nc.flush()
    await p.picker.add(W, p.sources)
    await until_async(lambda: p.stats().dumps_refused >= 1 and p.stats().fallback, "the refusal")
    assert p.stats().dumps == 0 and W in p.fallback.workers()
    await p.worker.sync(p.fallback, W)
    await p.store()
    await p.until_overlap(1, "the fallback's direct events")
    await nc.close()


async def test_no_relay_for_a_worker_is_a_failed_dump_not_a_malformed_one(plane):
    p = plane()
    await p.picker.add(W, p.sources)  # no relay serves W: the server answers "no responders"
    await until_async(lambda: p.stats().dump_failures >= 1 and p.stats().fallback, "the failed dump")
    assert p.stats().dumps_refused == 0 and p.picker.garbage == 0
    await p.start_relay()
    await until_async(lambda: p.stats().mode == "live" and not p.stats().fallback, "the relay's dump", timeout=15)


async def test_a_picker_started_while_nats_is_down_uses_zmq_then_joins_the_plane(plane, nats_server):  # noqa: F811
    await nats_server.stop()
    p = plane(first_connect_grace_s=0.5)
    p.relay = Relay([nats_server.url], p.subjects, {W: p.sources}, block_size=BS, heartbeat_s=0.2)
    await p.relay.start()  # it keeps trying to connect too, and reads the worker meanwhile
    await p.picker.add(W, p.sources)
    await until_async(lambda: p.stats().fallback and W in p.fallback.workers(), "the fallback after the grace")
    await p.worker.sync(p.fallback, W)
    await p.worker.sync(p.relay.subs, W)
    await p.store()
    await p.until_overlap(1, "the direct events meanwhile")
    await nats_server.start()
    await until_async(lambda: p.stats().mode == "live" and not p.stats().fallback, "joining the plane", timeout=20)
    assert p.fallback.workers() == [] and p.stats().recoveries == 1
    await p.until_overlap(1, "the dump")
    await p.store()
    await p.until_overlap(2, "the plane")


async def test_a_restarted_relay_rebuilds_from_the_engines_replay_where_it_has_one(plane, ctx):
    p = plane()
    p.worker.close()
    p.worker = FakeWorker(ctx, replay="trtllm")
    p.sources = [KvSource(p.worker.endpoint, p.worker.replay_endpoint)]
    await p.start_relay()
    await p.picker.add(W, p.sources)
    for _ in range(3):
        await p.store()
    await p.until_overlap(3)
    await p.stop_relay()
    await p.start_relay()  # a new relay: its warm-up replays the engine's buffer from 0
    await until_async(lambda: p.relay.idx.blocks_indexed(W) == 3, "the new relay's replay")
    await until_async(lambda: p.stats().relay_restarts >= 1 and p.stats().mode == "live", "the new epoch's dump")
    await p.until_overlap(3, "the dump of the rebuilt relay")
    assert p.stats().epoch == p.relay.epoch


async def test_a_gap_inside_the_messages_buffered_during_a_dump_asks_for_the_next_dump(plane, nats_server):  # noqa: F811
    """A hand-made relay: its first dump answer is late, and the live messages buffered meanwhile have a hole
    after the dump's position; the picker applies up to the hole and asks again at once."""
    from epp_extproc.dev.kvwire import pack_batch
    from epp_extproc.kvplane.wire import DumpChunk, encode_dump_chunk

    p = plane(dump_timeout_s=3.0)
    nc = await raw_client(nats_server)
    epoch, asked = 7, []
    release = asyncio.Event()

    async def relay(msg: Any) -> None:
        asked.append(1)
        if len(asked) == 1:
            await release.wait()  # answer the first request only after the live messages were sent
        seq = 1 if len(asked) == 1 else 3
        await nc.publish(msg.reply, encode_dump_chunk(DumpChunk(W, epoch, seq, 0, 1, BS, "events", [])))

    await nc.subscribe(p.subjects.dump(W), cb=relay)
    await nc.flush()
    await p.picker.add(W, p.sources)
    await until_async(lambda: asked, "the first dump request")
    batch = pack_batch([stored_event([1], None, block(0), BS)])
    for seq in (2, 4):  # seq 3 is lost
        await nc.publish(p.subjects.events(W), encode_live(KIND_BATCH, None, epoch, seq, seq, W, batch))
    await nc.flush()
    await until_async(lambda: p.stats().messages == 2, "both buffered")
    release.set()
    await until_async(lambda: len(asked) == 2 and p.stats().mode == "live", "the second dump")
    assert p.stats().gaps == 1 and p.stats().dumps == 2 and p.stats().seq == 4
    await nc.close()
