"""Integration: the KV-event subscriber under replay faults (issue 31 items 5-7), over real ZeroMQ against a copy
of vLLM's own publisher (`vllm/distributed/kv_events.py`, ``ZmqEventPublisher``): a PUB and a ROUTER served by
one thread that polls the ROUTER between queue reads, answers ``[b"", seq8, payload]`` per buffered batch from
the start seq and ends with ``[b"", ff*8, b""]``, and sends no heartbeats.  The copy runs in its own thread with
its own context, as vLLM's does, so it answers while the subscriber's event loop is stalled.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from typing import Any

import pytest
import zmq
import zmq.asyncio

import kvindex.subscriber as subscriber_module
from epp_extproc.dev.kvwire import pack_batch, stored_event
from kvindex.index import KvIndex
from kvindex.subscriber import SubscriberManager
from tests.netutil import free_port
from tests.waiting import until_async

BS = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block(i: int) -> list[int]:
    return list(range(1 + i * BS, 1 + (i + 1) * BS))


def stored(h: int, parent: int | None = None) -> list[dict[str, Any]]:
    """One batch storing one block with engine hash ``h`` (tokens derived from it)."""
    return [stored_event([h], parent, block(h), BS)]


class VllmPublisher:
    """vLLM's ``ZmqEventPublisher`` loop (PUB + ROUTER, one thread, a deque buffer, no heartbeat), with the
    faults these tests need: ``replay_delay_s`` (a replay endpoint slow to answer; the thread is busy meanwhile,
    as vLLM's would be), ``replay_ignore`` (requests read and never answered), ``replay_keep`` (each answer
    carries only its first n batches before the end marker: a ROUTER whose send HWM dropped the burst's tail),
    ``die_after_replay`` (the process dies right after it sent a replay's answer).
    ``publish(..., send=False)``: buffered but never sent (a batch the PUB's HWM dropped)."""

    def __init__(self, port: int | None = None, replay_port: int | None = None) -> None:
        self.port = port or free_port()
        self.replay_port = replay_port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
        self._ctx = zmq.Context()
        self._pub = self._bind(zmq.PUB, self.endpoint)
        self._pub.set_hwm(100_000)
        self._replay = self._bind(zmq.ROUTER, self.replay_endpoint)
        self._queue: queue.Queue[tuple[list, bool] | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self._seq = 0
        self._dead = threading.Event()
        self.published = 0
        self.requests: list[int] = []
        self.replay_delay_s = 0.0
        self.replay_ignore = 0
        self.replay_keep: int | None = None
        self.die_after_replay = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm-publisher")
        self._thread.start()

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for attempt in range(100):  # a restarted engine rebinds ports its predecessor just released
            try:
                sock.bind(endpoint)
                return sock
            except zmq.ZMQError:
                if attempt == 99:
                    raise
                time.sleep(0.02)
        raise AssertionError("unreachable")

    def publish(self, events: list, *, send: bool = True) -> None:
        self._queue.put((events, send))

    def _run(self) -> None:
        while not self._dead.is_set():
            if self._replay.poll(0):
                self._service_replay()
                if self._dead.is_set():
                    break
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                break
            events, send = item
            seq, self._seq = self._seq, self._seq + 1
            payload = pack_batch(events, rank=0, envelope="map")
            if send:
                self._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.published += 1

    def _service_replay(self) -> None:
        client_id, _, start8 = self._replay.recv_multipart()
        start = int.from_bytes(start8, "big")
        self.requests.append(start)
        if self.replay_ignore > 0:
            self.replay_ignore -= 1
            return
        if self.replay_delay_s and self._dead.wait(self.replay_delay_s):
            return  # the process died before it answered
        sent = 0
        for seq, buf in self._buffer:
            if seq >= start and (self.replay_keep is None or sent < self.replay_keep):
                self._replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), buf))
                sent += 1
        self._replay.send_multipart((client_id, b"", END_SEQ, b""))
        if self.die_after_replay:  # its sockets go with it at once
            self._dead.set()
            self._pub.close(linger=0)
            self._replay.close(linger=0)

    async def wait_published(self, n: int) -> None:
        await until_async(lambda: self.published >= n)

    def kill(self) -> None:
        """The engine process dies: its thread stops where it is and both sockets go with it."""
        self._dead.set()
        self._queue.put(None)
        self._thread.join(5)
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()


@pytest.fixture
async def setup():
    ctx = zmq.asyncio.Context()
    managers: list[SubscriberManager] = []
    pubs: list[VllmPublisher] = []

    def make(**kw: Any) -> tuple[KvIndex, SubscriberManager]:
        idx = KvIndex(default_block_size=BS)
        managers.append(SubscriberManager(idx, zmq_context=ctx, **kw))
        return idx, managers[-1]

    def publisher(**kw: Any) -> VllmPublisher:
        pubs.append(VllmPublisher(**kw))
        return pubs[-1]

    yield make, publisher
    for m in managers:
        await m.close()
    for p in pubs:
        if not p._dead.is_set():
            p.kill()
    ctx.destroy(linger=0)


@pytest.fixture
def quick_rewarm(monkeypatch):
    monkeypatch.setattr(subscriber_module, "REWARM_MIN_S", 0.1)
    monkeypatch.setattr(subscriber_module, "REWARM_MAX_S", 0.4)


# ------------------------------------------------------------------------------------------------------ item 6
async def test_a_replay_answer_that_arrived_during_a_loop_stall_is_read_not_timed_out(setup):
    """Three batches, then the subscriber, then the event loop stalls past replay_timeout_s while the engine
    answers the warm-up: the answer is in the DEALER socket and must be applied, not declared missing."""
    make, publisher = setup
    pub = publisher()
    pub.replay_delay_s = 0.1  # the answer comes while the loop is stalled
    for h in (1, 2, 3):
        pub.publish(stored(h, None if h == 1 else h - 1), send=False)
    await pub.wait_published(3)
    idx, mgr = make(replay_timeout_s=0.3)  # (vLLM's thread reads the ROUTER every 0.1 s at most)
    await mgr.add("w", pub.endpoint, pub.replay_endpoint)
    await until_async(lambda: pub.requests == [0])
    time.sleep(0.8)  # noqa: ASYNC251 - the stall under test: a flood, a long decision, a slow file parse
    pub.replay_delay_s = 0.0  # (only the warm-up's answer is slow)
    # well before any rebuild after a failure could run (REWARM_MIN_S)
    await until_async(lambda: idx.engine_hashes("w") == {1, 2, 3}, timeout=subscriber_module.REWARM_MIN_S / 4)
    assert mgr.stats("w").replay_failures == 0 and pub.published == 3


async def test_an_idle_engine_whose_warm_up_failed_is_warmed_later_without_a_new_live_message(setup, quick_rewarm):
    """vLLM sends no heartbeats: a failed warm-up retried only at the next message leaves an idle engine's
    cache invisible for good."""
    make, publisher = setup
    pub = publisher()
    pub.replay_ignore = 1  # the warm-up goes unanswered (an engine busy for a moment)
    for h in (1, 2, 3):
        pub.publish(stored(h, None if h == 1 else h - 1), send=False)
    await pub.wait_published(3)
    idx, mgr = make(replay_timeout_s=0.3)
    await mgr.add("w", pub.endpoint, pub.replay_endpoint)
    await until_async(lambda: idx.engine_hashes("w") == {1, 2, 3})
    assert mgr.stats("w").replay_failures == 1 and mgr.stats("w").messages == 0 and pub.requests[:2] == [0, 0]


# ------------------------------------------------------------------------------------------------------ item 5
async def test_a_replay_whose_tail_the_publisher_dropped_in_every_round_is_not_taken_as_complete(setup):
    """Each answer loses its tail to the send HWM but lets the end marker through: rounds that end on the end
    marker after batches are progress, not confirmations, however many there are."""
    make, publisher = setup
    pub = publisher()
    pub.replay_keep = 3
    n = 30
    for h in range(1, n + 1):
        pub.publish(stored(h, None if h == 1 else h - 1), send=False)
    await pub.wait_published(n)
    idx, mgr = make(replay_timeout_s=0.5)
    await mgr.add("w", pub.endpoint, pub.replay_endpoint)
    await until_async(lambda: mgr.stats("w").replay_ok + mgr.stats("w").replay_failures >= 1, timeout=15)
    assert idx.engine_hashes("w") == set(range(1, n + 1)) and mgr.stats("w").replay_failures == 0


async def test_a_replay_that_reaches_the_first_live_seq_needs_no_confirmation_round(setup):
    """The completion rule's other half: once the replay's last seq is the first live seq minus one, the live
    stream carries on and no round past the end is asked."""
    make, publisher = setup
    pub = publisher()
    idx, mgr = make(replay_timeout_s=0.5)
    await mgr.add("w", pub.endpoint, pub.replay_endpoint)
    for h in (1, 2):  # live until the subscriber demonstrably receives (a PUB drops messages before it joins)
        pub.publish(stored(h, None if h == 1 else h - 1))
    st = mgr.stats("w")
    while not (st.messages and st.replay_ok and st.last_seq == pub.published - 1):
        pub.publish([])
        await asyncio.sleep(0.05)
    applied, ok = pub.published - 1, st.replay_ok
    pub.publish(stored(10), send=False)  # lost on the wire
    pub.publish(stored(11))  # shows the gap
    await until_async(lambda: st.last_seq == applied + 2 and st.replay_ok == ok + 1)
    # every request of a finished replay was read by the publisher: the last one is the replay from `applied`
    assert pub.requests[-1] == applied and st.replay_failures == 0
    assert {10, 11} <= idx.engine_hashes("w")


# ------------------------------------------------------------------------------------------------------ item 7
async def test_an_engine_restart_during_a_slow_replay_leaves_none_of_the_dead_processes_blocks(setup):
    """The old engine's live batch is queued in the SUB (its first frame prefetched) while the subscriber waits
    for a slow replay; the engine answers, dies, and a new process on the same ports publishes one batch and
    idles.  The index must end up with the new process's block only."""
    make, publisher = setup
    old = publisher()
    old.publish(stored(1))
    await old.wait_published(1)
    idx, mgr = make(replay_timeout_s=1.0)
    await mgr.add("w", old.endpoint, old.replay_endpoint)
    await until_async(lambda: idx.engine_hashes("w") == {1})
    st = mgr.stats("w")
    while not (st.messages and st.last_seq == old.published - 1):  # live until the SUB demonstrably receives
        old.publish(stored(2, 1))
        await asyncio.sleep(0.05)
    old.replay_delay_s = 0.3  # the replay endpoint is slow to answer
    old.die_after_replay = True  # and the process dies right after answering
    old.publish(stored(3, 2), send=False)  # lost on the wire
    old.publish(stored(4, 3))  # shows the gap: the subscriber replays (slowly)
    old.publish(stored(5, 4))  # queued in the SUB meanwhile
    await until_async(lambda: old._dead.is_set())
    old.kill()
    new = publisher(port=old.port, replay_port=old.replay_port)
    await asyncio.sleep(0.3)  # the SUB reconnects to the new process
    new.publish(stored(9))
    await until_async(lambda: idx.engine_hashes("w") == {9}, timeout=10)


async def test_a_malformed_first_message_after_a_reconnect_is_taken_as_a_restart(setup):
    """Without a replay endpoint nothing else can tell: a garbled first batch from whatever now listens on the
    port (a restarted engine's, glued to a frame its predecessor left) must not leave the old blocks indexed."""
    make, _ = setup
    port = free_port()
    zctx = zmq.Context()
    old = zctx.socket(zmq.PUB)
    old.setsockopt(zmq.LINGER, 0)
    old.bind(f"tcp://127.0.0.1:{port}")
    idx, mgr = make()
    await mgr.add("w", f"tcp://127.0.0.1:{port}")
    seq = 0
    while idx.engine_hashes("w") != {1}:  # live until the SUB demonstrably receives
        old.send_multipart([b"", seq.to_bytes(8, "big"), pack_batch(stored(1), rank=0, envelope="map")])
        seq += 1
        await asyncio.sleep(0.05)
    old.close(linger=0)
    await until_async(lambda: mgr.stats("w").reconnects >= 1)
    new = zctx.socket(zmq.PUB)
    new.setsockopt(zmq.LINGER, 0)
    new.bind(f"tcp://127.0.0.1:{port}")
    try:
        while not idx.stats("w").garbage_frames:  # until the recreated SUB receives it
            new.send_multipart([b"", b"", (0).to_bytes(8, "big"), pack_batch(stored(9), rank=0, envelope="map")])
            await asyncio.sleep(0.05)
        assert idx.engine_hashes("w") == set() and mgr.stats("w").restarts == 1
    finally:
        new.close(linger=0)
        zctx.term()


# ------------------------------------------------------------------------------------ issue 43, item 4
def sub_pending(mgr: SubscriberManager) -> bool:
    """Whether worker w's subscription still holds a live message read during a replay and not handled yet."""
    return any(s.pending is not None for s in mgr._subs["w"])


async def restart_vllm(setup: Any, replay_timeout_s: float, slow_start: bool) -> None:
    """An old vLLM publisher applied live past seq 40, killed, and a new one on the same ports whose seq starts
    again at 0: one batch in its buffer only (published before the SUB joins), then live ones until the SUB
    receives one (a PUB sends nothing to a SUB that has not joined yet). ``slow_start``:
    the new process comes up only after the subscriber's reconnect check went unanswered. Asserts the restart
    is counted once and that no clear hit the new process's blocks (what the warm-up or rebuild restored)."""
    make, publisher = setup
    old = publisher()
    idx, mgr = make(replay_timeout_s=replay_timeout_s)
    await mgr.add("w", old.endpoint, old.replay_endpoint)
    st = mgr.stats("w")
    h = 0
    while not st.messages:  # live until the SUB demonstrably receives
        h += 1
        old.publish(stored(h, None if h == 1 else h - 1))
        await asyncio.sleep(0.05)
    while h <= 40:  # and past the seqs the new process will use
        h += 1
        old.publish(stored(h, h - 1))
    await until_async(lambda: old.published == h and st.last_seq == old.published - 1, timeout=10)
    bound = st.last_seq
    cleared_with: list[set[int]] = []  # what the index held at each clear of the worker
    clear_worker = idx.clear_worker

    def spy(worker_id: str, rank: int | None = None) -> None:
        cleared_with.append(idx.engine_hashes(worker_id))
        clear_worker(worker_id, rank)

    idx.clear_worker = spy  # type: ignore[method-assign]
    failures = st.replay_failures
    old.kill()
    if slow_start:
        await until_async(lambda: st.replay_failures > failures, timeout=10)  # the check went unanswered
    new = publisher(port=old.port, replay_port=old.replay_port)
    new.publish(stored(100), send=False)  # seq 0, before the SUB joins: only a replay brings it
    await until_async(lambda: idx.engine_hashes("w") == {100}, timeout=10)
    seen = st.messages
    h = 100
    while st.messages == seen:  # live (seq 1, 2, ...: below the old last seq) until the SUB receives one
        h += 1
        new.publish(stored(h, h - 1))
        await asyncio.sleep(0.05)
    # each applied, and each live copy handled (a replay still running may apply it first)
    await until_async(lambda: st.last_seq == new.published - 1 and idx.engine_hashes("w") == set(range(100, h + 1))
                      and not sub_pending(mgr), timeout=10)
    assert new.published - 1 < bound  # every live batch of the new process numbered below the dead one's
    assert st.restarts == 1, st
    assert not [held for held in cleared_with if held & set(range(100, h + 1))], cleared_with


async def test_a_restart_found_by_the_reconnect_check_is_counted_once_and_its_warm_up_kept(setup):
    """vLLM restarts and the new process is up when the subscriber, having lost its peer, checks the history
    by replay: the new buffer does not reach the old last seq, so that check finds the restart, clears and
    warms up from the new buffer. The new process's next live batch (a seq below the old process's last) is
    the same restart, not a second one: it must not be counted again nor clear the blocks the warm-up just
    restored (it did both while the dead process's live seq was kept as the bound)."""
    await restart_vllm(setup, replay_timeout_s=1.0, slow_start=False)


async def test_a_restart_found_by_the_rebuild_after_a_failed_check_is_counted_once_and_its_rebuild_kept(
        setup, quick_rewarm):
    """As above, with the new process slower to start (vLLM loads its model first): the reconnect check gets
    no answer, so the rebuild on the rewarm timer reads the new buffer. That buffer ends below the old last
    seq: the rebuild found the restart. The new process's next live batch must not clear what it rebuilt."""
    await restart_vllm(setup, replay_timeout_s=0.3, slow_start=True)
