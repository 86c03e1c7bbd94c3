"""Integration: a real ZeroMQ PUB (and ROUTER for replay) in the test, publishing to the real subscribers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

import kvindex.subscriber as subscriber_module
from epp_extproc.dev.kvwire import cleared_event, pack_batch, removed_event, stored_event
from kvindex.decode import encode_seq
from kvindex.index import KvIndex
from kvindex.subscriber import MAX_REPLAY_CONFIRMS, KvSource, SubscriberManager
from tests.mock.test_mock_support import ids_body, post, running_worker
from tests.netutil import free_base_port, free_port
from tests.waiting import until_async

BS = 4


def toks(n_blocks: int, start: int = 1) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def block(i: int) -> list[int]:
    """Tokens of block ``i`` of the prompt ``toks(n)``."""
    return toks(i + 1)[i * BS :]


class FakeWorker:
    """Plays a worker's KV-event publisher: PUB for live batches, optional ROUTER answering replays
    (``replay="trtllm"``: 4-frame replies with the topic, as TensorRT-LLM and vLLM 0.32+; ``"vllm"``: 3-frame,
    as vLLM <= 0.31 and SGLang)."""

    def __init__(self, ctx: zmq.asyncio.Context, *, replay: str | None = None, topic: bytes = b"",
                 port: int | None = None) -> None:
        self.topic = topic
        self.port = port or free_port()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 99
        self.replay_mode = replay
        self.replay_endpoint = None
        self.replay_requests: list[int] = []
        # replay faults: seqs left out of the next replays (a ROUTER dropping frames at its send HWM), a delay
        # before answering, garbage instead of answers, no end marker
        self.replay_drop: set[int] = set()
        self.replay_drop_times = 0
        self.replay_delay_s = 0.0
        self.replay_garbage = False
        self.replay_no_end = False
        self.replay_grows = False  # a busy engine: one more batch is published before each replay answer
        self.replay_ignore = 0  # the next n requests get no answer at all (an endpoint down or stalled)
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
            if self.replay_ignore > 0:
                self.replay_ignore -= 1
                continue
            if self.replay_delay_s:
                await asyncio.sleep(self.replay_delay_s)
            if self.replay_grows:
                await self.publish([])
            if self.replay_garbage:
                for _ in range(100):
                    await self.router.send_multipart([ident, b"", b"garbage"])
                continue
            drop = self.replay_drop if self.replay_drop_times > 0 else set()
            self.replay_drop_times -= 1
            for seq, payload in sorted(self.buffer):
                if seq in drop:
                    continue
                if seq >= start:
                    if self.replay_mode == "trtllm":
                        await self.router.send_multipart([ident, b"", self.topic, encode_seq(seq), payload])
                    else:
                        await self.router.send_multipart([ident, b"", encode_seq(seq), payload])
            end = [ident, b"", b"", b"\xff" * 8, b""] if self.replay_mode == "trtllm" else [ident, b"", b"\xff" * 8, b""]
            if not self.replay_no_end:
                await self.router.send_multipart(end)

    async def publish(
        self, events: list, *, send: bool = True, seq: int | None = None, topic: bytes | None = None,
        envelope: str = "array3",
    ) -> int:
        """Buffer (for replay) and, unless ``send`` is False (a dropped batch), publish the next batch."""
        self.seq = self.seq + 1 if seq is None else seq
        payload = pack_batch(events, rank=0, envelope=envelope)
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
        await until_async(lambda: st.last_seq == self.seq)

    def close(self) -> None:
        if self._task:
            self._task.cancel()
            self.router.close(0)
        self.pub.close(0)


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
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(2) + [0]) == {"w": 2}


@pytest.mark.parametrize("mode", ["trtllm", "vllm"])
async def test_gap_is_recovered_through_replay_without_losing_state(env, mode):
    idx, mgr, start = env
    w = await start(replay=mode)
    await w.publish([stored_event([1], None, block(0), BS)])
    await w.publish([stored_event([2], 1, block(1), BS)], send=False)  # lost on the wire
    seq = await w.publish([stored_event([3], 2, block(2), BS)])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(3) + [0]) == {"w": 3}
    # the replay starts at the last applied batch: its payload proves the publisher has the same history;
    # it reached the live batch that showed the gap (seq - 1 and past), so no confirmation round is needed
    assert mgr.stats("w").gaps == 1 and w.replay_requests[-1] == seq - 2


async def test_gap_without_replay_clears_the_worker(env):
    idx, mgr, start = env
    w = await start()
    await w.publish([stored_event([1], None, block(0), BS)])
    await w.publish([stored_event([2], 1, block(1), BS)], send=False)
    seq = await w.publish([])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(2) + [0]) == {} and mgr.stats("w").gaps == 1


async def test_replay_that_lost_the_missing_batches_is_counted_and_clears(env):
    idx, mgr, start = env
    w = await start(replay="trtllm")
    await w.publish([stored_event([1], None, block(0), BS)])
    await w.publish([stored_event([2], 1, block(1), BS)], send=False)
    w.buffer.pop()  # the replay buffer no longer holds the lost batch
    seq = await w.publish([])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert mgr.stats("w").replay_lost == 1 and idx.overlap(toks(1) + [0]) == {}


async def test_backwards_sequence_means_restart_and_clears(env):
    idx, mgr, start = env
    w = await start()
    await w.publish([stored_event([1], None, block(0), BS)])
    seq = await w.publish([], seq=0)
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert mgr.stats("w").restarts == 1 and idx.overlap(toks(1) + [0]) == {}


async def test_after_a_restart_new_events_are_indexed_again(env):
    idx, mgr, start = env
    w = await start()
    await w.publish([], seq=0)
    seq = await w.publish([stored_event([1], None, block(0), BS)])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(1) + [0]) == {"w": 1}


async def test_garbage_is_counted_and_the_subscriber_keeps_going(env):
    idx, mgr, start = env
    w = await start()
    await w.pub.send_multipart([b"only", b"two"])
    await w.pub.send_multipart([b"", b"short", b"x"])
    w.seq += 1
    await w.pub.send_multipart([b"", encode_seq(w.seq), b"\xc1\xc1"])
    seq = await w.publish([stored_event([1], None, block(0), BS)])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    st = idx.stats("w")
    assert (st.garbage_frames, st.garbage_batches) == (2, 1)
    assert idx.overlap(toks(1) + [0]) == {"w": 1}


async def test_heartbeating_worker_that_goes_silent_is_marked_stale(env):
    idx, mgr, start = env
    await start()
    await until_async(lambda: mgr.stats("w").stale, timeout=3)
    assert mgr.stats_snapshot()["w"]["stale"] is True


async def test_stale_worker_recovers_on_its_next_message(env):
    idx, mgr, start = env
    w = await start()
    await until_async(lambda: mgr.stats("w").stale, timeout=3)
    await w.publish([])
    await until_async(lambda: not mgr.stats("w").stale, timeout=3)


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
    await until_async(lambda: mgr.stats("a").last_seq == sa and mgr.stats("b").last_seq == sb)
    await mgr.remove("a")
    assert mgr.workers() == ["b"] and "a" not in idx.workers()
    assert idx.overlap(toks(1) + [0]) == {"b": 1}
    sb = await b.publish([stored_event([2], 1, block(1), BS)])
    await until_async(lambda: mgr.stats("b").last_seq == sb)
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
        await until_async(lambda: mgr.stats("w").last_seq == seq)
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
        await until_async(lambda: mgr.stats("w").last_seq == seq)
        assert idx.overlap(toks(1) + [0]) == {}
    finally:
        await mgr.close()
        w.close()


@pytest.fixture
async def custom(ctx):
    """Factories for an index + manager with test-specific settings and FakeWorkers, all closed afterwards."""
    managers: list[SubscriberManager] = []
    workers: list[FakeWorker] = []

    def make(*, registry: Any = None, **kw: Any) -> tuple[KvIndex, SubscriberManager]:
        idx = KvIndex(default_block_size=BS, registry=registry)
        managers.append(SubscriberManager(idx, zmq_context=ctx, registry=registry, **kw))
        return idx, managers[-1]

    def worker(**kw: Any) -> FakeWorker:
        workers.append(FakeWorker(ctx, **kw))
        return workers[-1]

    yield make, worker
    for m in managers:
        await m.close()
    for w in workers:
        w.close()


# ---------------------------------------------------------------------------------------------------------------
# Real-engine behaviours (issue 12): each test below failed on the subscriber/decoder before these fixes.

def chain_events(n: int, *, first_hash: int = 1) -> list[list[dict]]:
    """One batch per block of the prompt toks(n): block i has engine hash first_hash + i."""
    return [[stored_event([first_hash + i], None if i == 0 else first_hash + i - 1, block(i), BS)]
            for i in range(n)]


async def test_replay_with_a_hole_is_not_applied_as_complete_and_is_asked_again_from_the_hole(env):
    idx, mgr, start = env
    w = await start(replay="trtllm")
    await w.publish(chain_events(1)[0])
    for ev in chain_events(6)[1:]:
        await w.publish(ev, send=False)  # five batches lost on the wire
    w.replay_drop, w.replay_drop_times = {w.seq - 2}, 1  # and the first replay drops one in the middle
    seq = await w.publish([])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    # asked from the last applied batch, then again from the hole; that round reaches the live batch that showed
    # the gap, so no round past the end is needed to confirm it
    assert mgr.stats("w").replay_holes == 1 and w.replay_requests[-2:] == [seq - 6, seq - 3]
    assert idx.engine_hashes("w") == {1, 2, 3, 4, 5, 6}
    assert idx.overlap(toks(6) + [0]) == {"w": 6}


async def gap_with_faulty_replay(start: Callable, **faults: Any) -> FakeWorker:
    """A replaying worker whose block 0 was applied and block 1 lost; the next batch (sent here) reveals the gap
    and the replay that follows has ``faults`` (FakeWorker replay_* attributes)."""
    w = await start(replay="trtllm")
    await w.publish(chain_events(1)[0])
    await w.publish(chain_events(2)[1], send=False)
    for k, v in faults.items():
        setattr(w, k, v)
    await w.publish([])
    return w


async def test_replay_without_end_marker_is_a_failure_that_clears_not_a_success(env):
    idx, mgr, start = env
    await gap_with_faulty_replay(start, replay_no_end=True)
    await until_async(lambda: mgr.stats("w").replay_failures == 1, timeout=5)
    assert idx.engine_hashes("w") == set()


async def test_a_reset_during_an_in_flight_replay_drops_what_it_fetched_and_the_new_process_is_indexed(env):
    idx, mgr, start = env
    w = await start(replay="trtllm")
    await w.publish(chain_events(1)[0])
    await w.publish(chain_events(2)[1], send=False)
    w.replay_delay_s = 0.2
    asked = len(w.replay_requests)
    await w.publish([])  # gap: the subscriber waits for the slow replay
    await until_async(lambda: len(w.replay_requests) == asked + 1)
    mgr.resync("w")  # meanwhile the prober sees the worker die
    await asyncio.sleep(0.3)
    assert idx.engine_hashes("w") == set()
    # the restarted process numbers from 0 again: its batches must not be dropped as "old"
    w.replay_delay_s = 0.0
    w.buffer.clear()
    w.seq = -1
    seq = await w.publish([stored_event([50], None, block(0), BS)])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert idx.engine_hashes("w") == {50}


class _CloseOnReplayReply(zmq.asyncio.Socket):
    """A DEALER that starts its manager's close() in the very callback that completes a replay reply: the
    cancel lands on a task whose awaited result is already there (as when discovery removes a worker while
    its replay answers). ``asyncio.wait_for`` on Python 3.11 returns that result and swallows the cancel."""

    on_reply: Callable[[], None] | None = None

    def recv_multipart(self, *a: Any, **kw: Any) -> Any:
        fut = super().recv_multipart(*a, **kw)
        if self.socket_type == zmq.DEALER and type(self).on_reply is not None:
            fut.add_done_callback(lambda _f: type(self).on_reply())  # runs before the awaiting task resumes
        return fut


async def test_a_close_that_lands_as_a_replay_reply_arrives_still_stops_the_subscriber():
    ctx = zmq.asyncio.Context()
    ctx._socket_class = _CloseOnReplayReply
    idx = KvIndex(default_block_size=BS)
    mgr = SubscriberManager(idx, heartbeat_stale_s=0.2, zmq_context=ctx, replay_timeout_s=0.5)
    w = FakeWorker(ctx, replay="trtllm")
    closing: list[asyncio.Task] = []
    try:
        await mgr.add("w", w.endpoint, w.replay_endpoint)
        await w.sync(mgr, "w")
        await w.publish([stored_event([1], None, block(0), BS)], send=False)  # lost: the next one is a gap
        _CloseOnReplayReply.on_reply = lambda: closing.append(asyncio.ensure_future(mgr.close()))
        await w.publish([stored_event([2], 1, block(1), BS)])
        await until_async(lambda: bool(closing))
        # asyncio.wait, not a timeout: cancelling the waiter would cancel close() and, through it, the task
        done, _ = await asyncio.wait({closing[0]}, timeout=1.5)
        assert closing[0] in done  # before: the subscriber task ran on and close() waited for it forever
        assert closing[0].exception() is None
    finally:
        _CloseOnReplayReply.on_reply = None
        w.close()
        ctx.destroy(linger=0)


async def test_idle_worker_without_heartbeats_is_warmed_up_as_soon_as_the_subscriber_connects(custom):
    make, worker = custom
    idx, mgr = make(replay_timeout_s=0.5)
    w = worker(replay="vllm")
    for ev in chain_events(3):  # stored before the picker (re)started; the engine is idle now
        await w.publish(ev, send=False)
    await mgr.add("w", w.endpoint, w.replay_endpoint)
    await until_async(lambda: idx.engine_hashes("w") == {1, 2, 3})  # no live message was ever sent
    assert w.replay_requests == [0, w.seq + 1] and mgr.stats("w").messages == 0


async def test_a_batch_published_before_the_sub_joined_after_an_empty_warm_up_is_fetched_by_replay(custom):
    """A fresh engine (empty replay buffer) stores blocks right after the picker's warm-up was answered, before
    ZeroMQ has registered the SUB's subscription at the PUB: that batch only exists in the replay buffer, and
    the first live message after it must not be applied as if nothing came before it."""
    make, worker = custom
    idx, mgr = make(replay_timeout_s=0.5)
    w = worker(replay="vllm")
    await mgr.add("w", w.endpoint, w.replay_endpoint)
    await until_async(lambda: mgr.stats("w").replay_ok == 1)  # the warm-up found nothing
    await w.publish(chain_events(1)[0], send=False)  # the PUB had no subscriber yet: dropped on the wire
    await w.sync(mgr, "w")
    assert idx.engine_hashes("w") == {1}
    assert w.replay_requests[:2] == [0, 0]  # asked again from 0 at the first live message


async def test_an_empty_warm_up_is_rechecked_once_not_at_every_message(custom):
    make, worker = custom
    idx, mgr = make(replay_timeout_s=0.5)
    w = worker(replay="vllm")
    await mgr.add("w", w.endpoint, w.replay_endpoint)
    await until_async(lambda: mgr.stats("w").replay_ok == 1)
    await w.sync(mgr, "w")
    asked = len(w.replay_requests)
    for _ in range(5):
        await w.publish([])
    await until_async(lambda: mgr.stats("w").last_seq == w.seq)
    assert len(w.replay_requests) == asked and mgr.stats("w").gaps == 0


async def heartbeat_until(w: FakeWorker, pred: Callable[[], bool], timeout: float = 5.0) -> None:
    """Keep a live stream going (a busy engine's heartbeats) until ``pred`` holds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await w.publish([])
        await asyncio.sleep(0.02)


@pytest.fixture
def quick_rewarm(monkeypatch):
    monkeypatch.setattr(subscriber_module, "REWARM_MIN_S", 0.1)
    monkeypatch.setattr(subscriber_module, "REWARM_MAX_S", 0.4)


async def test_a_warm_up_whose_replay_timed_out_is_rebuilt_from_the_buffer_later(custom, quick_rewarm):
    """A replay endpoint that did not answer in time (an engine busy for a moment) must not leave the cache
    the worker held before the picker started invisible for good."""
    make, worker = custom
    idx, mgr = make(replay_timeout_s=0.2)
    w = worker(replay="vllm")
    for ev in chain_events(3):
        await w.publish(ev, send=False)
    w.replay_ignore = 2  # the warm-up and its recheck at the first live message
    await mgr.add("w", w.endpoint, w.replay_endpoint)
    await heartbeat_until(w, lambda: idx.engine_hashes("w") == {1, 2, 3})
    assert mgr.stats("w").replay_failures == 2 and w.replay_requests[:3] == [0, 0, 0]


async def test_while_the_replay_endpoint_stays_down_live_state_is_kept_and_rebuilds_back_off(custom, quick_rewarm):
    make, worker = custom
    idx, mgr = make(replay_timeout_s=0.05)
    w = worker(replay="vllm")
    w.replay_ignore = 10**9
    await mgr.add("w", w.endpoint, w.replay_endpoint)
    await w.sync(mgr, "w")
    seq = await w.publish(chain_events(1)[0])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    clears = idx.stats("w").clears  # the failed warm-up and its recheck cleared an empty rank
    await w.publish([], send=False)  # a gap while a rebuild is pending: cleared, not one more replay
    t0, asked = time.monotonic(), len(w.replay_requests)
    seq = await w.publish(chain_events(1, first_hash=10)[0])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    for _ in range(80):  # 1.6 s of messages: one rebuild per backoff period, not one per message
        await w.publish([])
        await asyncio.sleep(0.02)
    assert idx.stats("w").clears == clears + 1 and mgr.stats("w").gaps == 1  # the gap's clear, nothing else
    assert idx.engine_hashes("w") == {10}  # unanswered rebuilds leave what the live stream brought
    assert 3 <= len(w.replay_requests) - asked <= (time.monotonic() - t0) / 0.1 + 1 < 80


async def test_a_replay_over_its_budget_is_not_asked_again(custom, quick_rewarm):
    """The buffer would overrun the budget again: rebuilding would cost the whole budget every period."""
    make, worker = custom
    idx, mgr = make(replay_timeout_s=0.2, replay_max_batches=2)
    w = worker(replay="vllm")
    for ev in chain_events(3):
        await w.publish(ev, send=False)
    await mgr.add("w", w.endpoint, w.replay_endpoint)
    await heartbeat_until(w, lambda: mgr.stats("w").messages > 0)
    asked = len(w.replay_requests)
    for _ in range(30):
        await w.publish([])
        await asyncio.sleep(0.02)
    assert len(w.replay_requests) == asked and mgr.stats("w").oversized >= 1


async def test_a_publisher_that_answers_every_confirmation_with_new_batches_ends_the_replay_as_complete(custom):
    """Confirmation rounds end where the live stream starts: a busy engine's newest batches are left to it."""
    make, worker = custom
    idx, mgr = make(replay_timeout_s=0.5)
    w = worker(replay="vllm")
    for ev in chain_events(3):
        await w.publish(ev, send=False)
    w.replay_grows = True
    await mgr.add("w", w.endpoint, w.replay_endpoint)
    await until_async(lambda: mgr.stats("w").replay_ok == 1)
    assert len(w.replay_requests) <= MAX_REPLAY_CONFIRMS + 1 and mgr.stats("w").replay_failures == 0
    assert idx.engine_hashes("w") == {1, 2, 3}


async def test_replay_whose_last_batches_are_dropped_before_the_end_marker_fetches_them_again(custom):
    """A full send HWM drops the tail of a burst and the end marker can still get through: it must not look
    complete (the engine is idle, so no live batch would ever reveal the loss)."""
    make, worker = custom
    idx, mgr = make(replay_timeout_s=0.5)
    w = worker(replay="vllm")
    for ev in chain_events(4):
        await w.publish(ev, send=False)
    w.replay_drop, w.replay_drop_times = {w.seq - 1, w.seq}, 1  # the first replay loses its last two
    await mgr.add("w", w.endpoint, w.replay_endpoint)
    await until_async(lambda: idx.engine_hashes("w") == {1, 2, 3, 4})
    assert w.replay_requests == [0, w.seq - 1, w.seq + 1] and mgr.stats("w").replay_failures == 0


async def test_restart_whose_first_seen_seq_is_above_the_old_one_is_detected_and_the_old_blocks_dropped(env):
    idx, mgr, start = env
    w = await start(replay="trtllm")
    for ev in chain_events(2):
        await w.publish(ev)
    await until_async(lambda: idx.engine_hashes("w") == {1, 2})
    old_last = w.seq
    # the worker restarts and its first batches are lost to the slow-joining SUB: the first one seen is
    # above the old last seq, and the replay buffer holds the NEW process's history
    w.buffer.clear()
    w.seq = -1
    for ev in chain_events(old_last + 3, first_hash=1000)[: old_last + 3]:
        await w.publish(ev, send=False)
    seq = await w.publish([])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert mgr.stats("w").restarts == 1
    assert idx.engine_hashes("w") == set(range(1000, 1000 + old_last + 3))


async def test_far_sequence_jump_is_a_restart(env):
    idx, mgr, start = env
    w = await start()
    await w.publish(chain_events(1)[0])
    seq = await w.publish([stored_event([7], None, block(0), BS)], seq=time.time_ns())
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert mgr.stats("w").restarts == 1 and idx.engine_hashes("w") == {7}


async def test_vllm_salt_in_the_first_blocks_extra_keys_matches_salted_prompts_only(env):
    idx, mgr, start = env
    w = await start()
    ev = stored_event([1, 2], None, toks(2), BS, extra_keys=[["tenant-a"], None])
    seq = await w.publish([ev], envelope="map")
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(2) + [0], salt="tenant-a") == {"w": 2}
    assert idx.overlap(toks(2) + [0]) == {} and idx.overlap(toks(2) + [0], salt="tenant-b") == {}


async def test_sglang_typed_cache_salt_is_not_credited_to_unsalted_prompts(env):
    idx, mgr, start = env
    w = await start()
    seq = await w.publish([stored_event([1, 2], None, toks(2), BS, cache_salt="tenant-a", session_id="s1")])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(2) + [0]) == {}
    assert idx.overlap(toks(2) + [0], salt="tenant-a") == {"w": 2}
    assert idx.stats("w").unknown_keys == 0


@pytest.mark.parametrize("keys", [[["ad"], ["ad"]], [[{"type": "lora", "name": "ad"}]] * 2])
async def test_vllm_lora_blocks_are_indexed_under_their_adapter(env, keys):
    idx, mgr, start = env
    w = await start()
    seq = await w.publish([stored_event([1, 2], None, toks(2), BS, lora_id=1, lora_name="ad", extra_keys=keys)])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert idx.overlap(toks(2) + [0], lora_name="ad") == {"w": 2}
    assert idx.overlap(toks(2) + [0]) == {}


async def test_gap_warnings_are_one_per_burst(env, caplog):
    idx, mgr, start = env
    w = await start()
    with caplog.at_level(logging.WARNING, logger="kvindex.subscriber"):
        for _ in range(20):
            await w.publish([], send=False)
            seq = await w.publish([])
        await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert mgr.stats("w").gaps == 20 and mgr.stats("w").dropped_batches == 20
    assert caplog.text.count("gap") == 1


async def test_subscriber_that_never_receives_anything_from_a_healthy_worker_says_so(custom, caplog):
    make, worker = custom
    idx, mgr = make(topic="kv", heartbeat_stale_s=0.2, silent_after_s=0.3, is_healthy=lambda _w: True)
    w = worker(topic=b"other")  # publishes on another topic than the one subscribed
    with caplog.at_level(logging.WARNING, logger="kvindex.subscriber"):
        await mgr.add("w", w.endpoint)
        for _ in range(40):
            await w.publish([])
            await asyncio.sleep(0.02)
    assert mgr.stats_snapshot()["w"]["silent"] is True
    assert caplog.text.count("no KV events from w") == 1


async def test_garbage_replay_replies_do_not_freeze_the_subscriber(env):
    idx, mgr, start = env
    w = await gap_with_faulty_replay(start, replay_garbage=True)
    seq = await w.publish([stored_event([9], None, block(0), BS)])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert mgr.stats("w").replay_failures >= 1 and 9 in idx.engine_hashes("w")


async def test_batch_over_the_event_budget_is_refused_and_the_rank_cleared(custom):
    make, worker = custom
    idx, mgr = make(max_batch_events=4)
    w = worker()
    await mgr.add("w", w.endpoint)
    await w.sync(mgr, "w")
    await w.publish(chain_events(1)[0])
    seq = await w.publish([removed_event([99])] * 5)
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert mgr.stats("w").oversized == 1 and idx.engine_hashes("w") == set()
    assert idx.stats("w").removed_unknown == 0  # refused before it was applied


async def test_frame_over_the_byte_budget_is_refused_by_zeromq_and_the_stream_goes_on(custom):
    make, worker = custom
    idx, mgr = make(max_batch_bytes=64 * 1024)
    w = worker()
    await mgr.add("w", w.endpoint)
    await w.sync(mgr, "w")
    await w.pub.send_multipart([b"", encode_seq(w.seq + 1), b"\x00" * (1 << 20)])
    w.seq += 1
    deadline = time.monotonic() + 5
    while 42 not in idx.engine_hashes("w"):  # the SUB reconnects after ZeroMQ dropped the peer
        assert time.monotonic() < deadline
        await w.publish([stored_event([42], None, block(0), BS)])
        await asyncio.sleep(0.05)
    assert idx.stats("w").garbage_batches == 0  # never buffered whole, never decoded
    assert mgr.stats("w").reconnects >= 1


async def test_a_flood_does_not_starve_the_event_loop(custom):
    make, worker = custom
    idx, mgr = make(turn_budget_s=0.002)
    w = worker()
    w.pub.setsockopt(zmq.SNDHWM, 0)
    await mgr.add("w", w.endpoint)
    await w.sync(mgr, "w")
    payload = pack_batch([stored_event(list(range(i, i + 64)), None, list(range(64 * BS)), BS)
                          for i in range(0, 640, 64)])
    for _ in range(3000):  # queued faster than it is applied
        w.seq += 1
        w.pub.send_multipart([b"", encode_seq(w.seq), payload])
    stalls: list[float] = []
    last = start = time.perf_counter()
    while mgr.stats("w").last_seq != w.seq and last - start < 3.0:
        await asyncio.sleep(0)
        now = time.perf_counter()
        stalls.append(now - last)
        last = now
    assert mgr.stats("w").messages > 100  # it did ingest meanwhile
    assert max(stalls) < 0.3, f"the loop stalled {max(stalls):.3f}s"  # ~1 s without the turn budget


# ---------------------------------------------------------------------------------------------------------------
# Against trtllm_mock playing each engine's publisher: after every fault the index must equal what the mock holds.

async def mock_cache(s: aiohttp.ClientSession, m: Any) -> dict:
    async with s.get(m.url + "/mock/cache") as r:
        return await r.json()


async def mock_hashes(s: aiohttp.ClientSession, m: Any) -> set[int]:
    return {b["engine_hash"] for b in (await mock_cache(s, m))["blocks"]}


async def chat(s: aiohttp.ClientSession, m: Any, prompt: list[int], **extra: Any) -> None:
    status, body = await post(s, m.url + "/v1/chat/completions", ids_body(prompt, **extra))
    assert status == 200, body


async def index_matches(idx: KvIndex, s: aiohttp.ClientSession, m: Any, wid: str = "m", timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        want = await mock_hashes(s, m)
        if idx.engine_hashes(wid) == want and want:
            return
        if time.monotonic() > deadline:
            have = idx.engine_hashes(wid)
            raise AssertionError(f"index holds {len(have)} blocks, the mock {len(want)}: {len(have - want)} "
                                 f"extra, {len(want - have)} missing; {idx.snapshot()['workers'].get(wid)}")
        await asyncio.sleep(0.05)


def prompts(n: int, length: int = 3 * BS + 1) -> list[list[int]]:
    """n prompts with distinct first blocks, inside the mock's vocabulary."""
    return [[100 + (i * 7919 + j) % 31_000 for j in range(length)] for i in range(n)]


async def test_large_replay_through_a_dropping_router_converges_to_what_the_mock_holds(custom):
    """vLLM <= 0.11, SGLang 0.5 and TensorRT-LLM keep the ROUTER's default send HWM: big replays lose frames."""
    async with running_worker(tokens_per_block=BS, num_blocks=100_000, replay_hwm=20, replay_buffer=5000,
                              replay_endpoint=f"tcp://127.0.0.1:{free_port()}") as m, aiohttp.ClientSession() as s:
        for p in prompts(400):  # stored while no picker listens: only the replay can tell
            await chat(s, m, p)
        idx, mgr = custom[0](replay_timeout_s=0.3)
        await mgr.add("m", m.kv_events_endpoint, m.replay_endpoint)
        await index_matches(idx, s, m, timeout=30)
        assert mgr.stats("m").replay_holes >= 1  # the mock did drop frames: the fix was exercised


@pytest.mark.parametrize("dialect", ["vllm", "vllm-array", "sglang"])
async def test_salted_blocks_of_each_engine_match_salted_prompts_like_the_engine_does(custom, dialect):
    async with running_worker(tokens_per_block=BS, event_dialect=dialect, heartbeat_interval=0.05,
                              replay_endpoint=f"tcp://127.0.0.1:{free_port()}") as m, aiohttp.ClientSession() as s:
        idx, mgr = custom[0](replay_timeout_s=0.5)
        await mgr.add("m", m.kv_events_endpoint, m.replay_endpoint)
        p = prompts(1)[0]
        await chat(s, m, p, cache_salt="tenant-a")
        await index_matches(idx, s, m)
        assert idx.overlap(p, salt="tenant-a") == {"m": 3}
        assert idx.overlap(p) == {} and idx.overlap(p, salt="tenant-b") == {}  # no cross-tenant credit


async def test_sglang_bigram_pages_are_decoded_not_counted_as_garbage(custom):
    async with running_worker(tokens_per_block=BS, event_dialect="sglang", bigram_pages=True,
                              heartbeat_interval=0.05) as m, aiohttp.ClientSession() as s:
        idx, mgr = custom[0]()
        await mgr.add("m", m.kv_events_endpoint)
        await until_async(lambda: mgr.stats("m").messages > 0)
        p = prompts(1)[0]
        await chat(s, m, p)
        await index_matches(idx, s, m)
        assert idx.overlap(p) == {"m": 3} and idx.stats("m").garbage_events == 0


async def test_hybrid_tail_blocks_in_another_block_size_never_wipe_the_worker(custom):
    async with running_worker(tokens_per_block=BS, tail_block_size=2, heartbeat_interval=0.05) as m, \
            aiohttp.ClientSession() as s:
        idx, mgr = custom[0]()
        await mgr.add("m", m.kv_events_endpoint)
        await until_async(lambda: mgr.stats("m").messages > 0)
        for p in prompts(3, length=3 * BS + 3):  # each prompt leaves a 3-token tail: one 2-token tail block
            await chat(s, m, p)
        await until_async(lambda: idx.stats("m").skipped_unknown_parent == 3)
        await index_matches(idx, s, m)
        assert idx.stats("m").clears == 0 and idx.block_size("m") == BS


async def test_data_parallel_ranks_on_base_port_plus_rank_are_all_kept_under_one_worker(custom):
    base = free_base_port((0, 1))  # rank r binds base + r, like the engines
    ep = f"tcp://127.0.0.1:{base}"
    async with running_worker(tokens_per_block=BS, kv_events_endpoint=ep, dp_rank=0, heartbeat_interval=0.05) as r0, \
            running_worker(tokens_per_block=BS, kv_events_endpoint=ep, dp_rank=1, heartbeat_interval=0.05) as r1, \
            aiohttp.ClientSession() as s:
        assert r1.kv_events_endpoint == f"tcp://127.0.0.1:{base + 1}"
        idx, mgr = custom[0]()
        await mgr.add("w", [KvSource(ep, None, 0), KvSource(f"tcp://127.0.0.1:{base + 1}", None, 1)])
        await until_async(lambda: all(mgr.stats("w", r).messages > 0 for r in (0, 1)))
        a, b = prompts(2)
        await chat(s, r0, a)
        await chat(s, r1, b[: 2 * BS + 1])
        await chat(s, r1, a[: 2 * BS + 1])
        for rank, m in ((0, r0), (1, r1)):
            want = await mock_hashes(s, m)
            await until_async(lambda rank=rank, want=want: idx.engine_hashes("w", rank) == want)
        assert idx.overlap(a) == {"w": 3}  # best over the ranks: rank 0 holds 3 blocks of a, rank 1 holds 2
        assert idx.overlap(b) == {"w": 2}


async def test_subscriber_counters_are_exported_by_their_own_collector(custom):
    from prometheus_client import CollectorRegistry

    make, worker = custom
    reg = CollectorRegistry()
    idx, mgr = make(registry=reg)
    w = worker()
    await mgr.add("w", w.endpoint)
    await w.sync(mgr, "w")
    await w.publish([], send=False)
    seq = await w.publish([])
    await until_async(lambda: mgr.stats("w").last_seq == seq)
    assert reg.get_sample_value("epp_kv_seq_gaps_total", {"worker": "w"}) == 1
    assert reg.get_sample_value("epp_kv_dropped_batches_total", {"worker": "w"}) == 1
    assert reg.get_sample_value("epp_kv_last_seq", {"worker": "w"}) == seq
