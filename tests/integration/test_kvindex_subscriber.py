"""Integration: a real ZeroMQ PUB (and ROUTER for replay) in the test, publishing to the real subscribers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from bench.kvwire import cleared_event, pack_batch, stored_event
from kvindex.decode import encode_seq
from kvindex.index import KvIndex
from kvindex.subscriber import SubscriberManager
from tests.netutil import free_port

BS = 4


def toks(n_blocks: int, start: int = 1) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def block(i: int) -> list[int]:
    """Tokens of block ``i`` of the prompt ``toks(n)``."""
    return toks(i + 1)[i * BS :]


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


class FakeWorker:
    """Plays a worker's KV-event publisher: PUB for live batches, optional ROUTER answering replays."""

    def __init__(self, ctx: zmq.asyncio.Context, *, replay: str | None = None, topic: bytes = b"") -> None:
        self.topic = topic
        self.port = free_port()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 99
        self.replay_mode = replay
        self.replay_endpoint = None
        self.replay_requests: list[int] = []
        self._task = None
        if replay:
            rport = free_port()
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{rport}")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._task = asyncio.create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start8 = await self.router.recv_multipart()
            start = int.from_bytes(start8, "big")
            self.replay_requests.append(start)
            for seq, payload in sorted(self.buffer):
                if seq >= start:
                    if self.replay_mode == "trtllm":
                        await self.router.send_multipart([ident, b"", self.topic, encode_seq(seq), payload])
                    else:
                        await self.router.send_multipart([ident, b"", encode_seq(seq), payload])
            end = [ident, b"", b"", b"\xff" * 8, b""] if self.replay_mode == "trtllm" else [ident, b"", b"\xff" * 8, b""]
            await self.router.send_multipart(end)

    async def publish(
        self, events: list, *, send: bool = True, seq: int | None = None, topic: bytes | None = None
    ) -> int:
        """Buffer (for replay) and, unless ``send`` is False (a dropped batch), publish the next batch."""
        self.seq = self.seq + 1 if seq is None else seq
        payload = pack_batch(events, rank=0)
        self.buffer.append((self.seq, payload))
        if send:
            await self.pub.send_multipart([self.topic if topic is None else topic, encode_seq(self.seq), payload])
        return self.seq

    async def sync(self, mgr: SubscriberManager, worker_id: str) -> None:
        """Heartbeat until the subscriber demonstrably receives (PUB drops messages before it connects)."""
        st = mgr.stats(worker_id)
        deadline = time.monotonic() + 5
        while st.last_seq is None:
            assert time.monotonic() < deadline, "subscriber never connected"
            await self.publish([])
            for _ in range(5):
                await asyncio.sleep(0.01)
                if st.last_seq is not None:
                    break
        await until(lambda: st.last_seq == self.seq)

    def close(self) -> None:
        if self._task:
            self._task.cancel()
            self.router.close(0)
        self.pub.close(0)


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.term()


@pytest.fixture
async def env(ctx):
    idx = KvIndex(default_block_size=BS)
    mgr = SubscriberManager(idx, heartbeat_stale_s=0.2, zmq_context=ctx, replay_timeout_s=0.5)
    workers: list[FakeWorker] = []

    async def start(worker_id: str = "w", **kw) -> FakeWorker:
        w = FakeWorker(ctx, **kw)
        workers.append(w)
        await mgr.add(worker_id, w.endpoint, w.replay_endpoint)
        await w.sync(mgr, worker_id)
        return w

    yield idx, mgr, start
    await mgr.close()
    for w in workers:
        w.close()


async def test_published_blocks_reach_the_index(env):
    idx, mgr, start = env
    w = await start()
    seq = await w.publish([stored_event([1, 2], None, toks(2), BS)])
    await until(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(2) + [0]) == {"w": 2}


@pytest.mark.parametrize("mode", ["trtllm", "vllm"])
async def test_gap_is_recovered_through_replay_without_losing_state(env, mode):
    idx, mgr, start = env
    w = await start(replay=mode)
    await w.publish([stored_event([1], None, block(0), BS)])
    await w.publish([stored_event([2], 1, block(1), BS)], send=False)  # lost on the wire
    seq = await w.publish([stored_event([3], 2, block(2), BS)])
    await until(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(3) + [0]) == {"w": 3}
    # the replay starts at the last applied batch: its payload proves the publisher has the same history
    assert mgr.stats("w").gaps == 1 and w.replay_requests[-1] == seq - 2


async def test_gap_without_replay_clears_the_worker(env):
    idx, mgr, start = env
    w = await start()
    await w.publish([stored_event([1], None, block(0), BS)])
    await w.publish([stored_event([2], 1, block(1), BS)], send=False)
    seq = await w.publish([])
    await until(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(2) + [0]) == {} and mgr.stats("w").gaps == 1


async def test_replay_that_lost_the_missing_batches_is_counted_and_clears(env):
    idx, mgr, start = env
    w = await start(replay="trtllm")
    await w.publish([stored_event([1], None, block(0), BS)])
    await w.publish([stored_event([2], 1, block(1), BS)], send=False)
    w.buffer.pop()  # the replay buffer no longer holds the lost batch
    seq = await w.publish([])
    await until(lambda: mgr.stats("w").last_seq == seq)
    assert mgr.stats("w").replay_lost == 1 and idx.overlap(toks(1) + [0]) == {}


async def test_backwards_sequence_means_restart_and_clears(env):
    idx, mgr, start = env
    w = await start()
    await w.publish([stored_event([1], None, block(0), BS)])
    seq = await w.publish([], seq=0)
    await until(lambda: mgr.stats("w").last_seq == seq)
    assert mgr.stats("w").restarts == 1 and idx.overlap(toks(1) + [0]) == {}


async def test_after_a_restart_new_events_are_indexed_again(env):
    idx, mgr, start = env
    w = await start()
    await w.publish([], seq=0)
    seq = await w.publish([stored_event([1], None, block(0), BS)])
    await until(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(1) + [0]) == {"w": 1}


async def test_garbage_is_counted_and_the_subscriber_keeps_going(env):
    idx, mgr, start = env
    w = await start()
    await w.pub.send_multipart([b"only", b"two"])
    await w.pub.send_multipart([b"", b"short", b"x"])
    w.seq += 1
    await w.pub.send_multipart([b"", encode_seq(w.seq), b"\xc1\xc1"])
    seq = await w.publish([stored_event([1], None, block(0), BS)])
    await until(lambda: mgr.stats("w").last_seq == seq)
    st = idx.stats("w")
    assert (st.garbage_frames, st.garbage_batches) == (2, 1)
    assert idx.overlap(toks(1) + [0]) == {"w": 1}


async def test_heartbeating_worker_that_goes_silent_is_marked_stale(env):
    idx, mgr, start = env
    await start()
    await until(lambda: mgr.stats("w").stale, timeout=3)
    assert mgr.stats_snapshot()["w"]["stale"] is True


async def test_stale_worker_recovers_on_its_next_message(env):
    idx, mgr, start = env
    w = await start()
    await until(lambda: mgr.stats("w").stale, timeout=3)
    await w.publish([])
    await until(lambda: not mgr.stats("w").stale, timeout=3)


async def test_worker_that_never_heartbeats_is_not_marked_stale(ctx):
    idx = KvIndex(default_block_size=BS)
    mgr = SubscriberManager(idx, heartbeat_stale_s=0.2, zmq_context=ctx)
    w = FakeWorker(ctx)
    try:
        await mgr.add("w", w.endpoint)
        st = mgr.stats("w")
        while st.last_seq is None:
            await w.publish([stored_event([w.seq], None, block(0), BS)])
            await asyncio.sleep(0.02)
        assert mgr.check_stale(now=time.monotonic() + 60) == []
    finally:
        await mgr.close()
        w.close()


async def test_workers_added_and_removed_at_runtime(env):
    idx, mgr, start = env
    a = await start("a")
    b = await start("b")
    sa = await a.publish([stored_event([1], None, block(0), BS)])
    sb = await b.publish([stored_event([1], None, block(0), BS)])
    await until(lambda: mgr.stats("a").last_seq == sa and mgr.stats("b").last_seq == sb)
    await mgr.remove("a")
    assert mgr.workers() == ["b"] and "a" not in idx.workers()
    assert idx.overlap(toks(1) + [0]) == {"b": 1}
    sb = await b.publish([stored_event([2], 1, block(1), BS)])
    await until(lambda: mgr.stats("b").last_seq == sb)
    assert idx.overlap(toks(2) + [0]) == {"b": 2}


async def test_new_subscriber_warms_up_from_the_replay_buffer(ctx):
    idx = KvIndex(default_block_size=BS)
    mgr = SubscriberManager(idx, zmq_context=ctx, replay_timeout_s=0.5)
    w = FakeWorker(ctx, replay="trtllm")
    try:
        # blocks stored before the picker started: published to nobody, still in the replay buffer
        await w.publish([cleared_event()], send=False)
        await w.publish([stored_event([1, 2], None, toks(2), BS)], send=False)
        await mgr.add("w", w.endpoint, w.replay_endpoint)
        await w.sync(mgr, "w")
        assert w.replay_requests[0] == 0
        assert idx.overlap(toks(2) + [0]) == {"w": 2}
    finally:
        await mgr.close()
        w.close()


async def test_dead_replay_endpoint_is_counted_and_live_events_still_flow(ctx):
    idx = KvIndex(default_block_size=BS)
    mgr = SubscriberManager(idx, zmq_context=ctx, replay_timeout_s=0.1)
    w = FakeWorker(ctx)
    try:
        await mgr.add("w", w.endpoint, f"tcp://127.0.0.1:{free_port()}")
        await w.sync(mgr, "w")
        seq = await w.publish([stored_event([1], None, block(0), BS)])
        await until(lambda: mgr.stats("w").last_seq == seq)
        assert mgr.stats("w").replay_failures >= 1
        assert idx.overlap(toks(1) + [0]) == {"w": 1}
    finally:
        await mgr.close()
        w.close()


async def test_only_the_configured_topic_is_indexed(ctx):
    idx = KvIndex(default_block_size=BS)
    mgr = SubscriberManager(idx, topic="kv", zmq_context=ctx)
    w = FakeWorker(ctx, topic=b"kv")
    try:
        await mgr.add("w", w.endpoint)
        await w.sync(mgr, "w")
        # had the filter let it through, this store would be applied (the next seq follows on)
        await w.publish([stored_event([1], None, block(0), BS)], topic=b"other")
        seq = await w.publish([])
        await until(lambda: mgr.stats("w").last_seq == seq)
        assert idx.overlap(toks(1) + [0]) == {}
    finally:
        await mgr.close()
        w.close()
