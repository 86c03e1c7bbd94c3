"""Integration: how live batches reach the index once the subscriber waits on its sockets' descriptors itself
(kvindex/subscriber.py `_open_socket`, `_wake`, `_apply_ready`): every batch, in order, within the turn budget
and the pacing budget, without re-registering a descriptor or resuming the subscription's task per batch."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from epp_extproc.dev.kvwire import stored_event
from kvindex.decode import decode_payload
from kvindex.index import KvIndex
from kvindex.subscriber import SubscriberManager
from tests.integration.test_kvindex_subscriber import BS, FakeWorker, block
from tests.waiting import until_async

N = 300


async def _chain(w: FakeWorker, n: int, *, first: int = 1) -> int:
    """Publish `n` batches back to back, each one block continuing the last: any batch lost or applied out of
    order leaves the rest of the chain unindexed (an unknown parent)."""
    seq = 0
    for i in range(n):
        h = first + i
        seq = await w.publish([stored_event([h], None if h == 1 else h - 1, block(h - 1), BS)])
    return seq


@contextlib.asynccontextmanager
async def _subscribed(ctx: Any, **manager_kw: Any) -> AsyncIterator[tuple[KvIndex, SubscriberManager, FakeWorker]]:
    """An index, its subscriber manager and one fake worker "w", subscribed and in sync; closed after."""
    idx = KvIndex(default_block_size=BS)
    mgr = SubscriberManager(idx, zmq_context=ctx, **manager_kw)
    w = FakeWorker(ctx)
    try:
        await mgr.add("w", w.endpoint)
        await w.sync(mgr, "w")
        yield idx, mgr, w
    finally:
        await mgr.close()
        w.close()


def _reference(w: FakeWorker) -> KvIndex:
    """The index the published batches make when applied directly, in order."""
    ref = KvIndex(default_block_size=BS)
    for _, payload in sorted(w.buffer):
        ref.apply_batch("w", decode_payload(payload))
    return ref


@pytest.mark.parametrize("turn_budget_s", [0.005, 1e-6])
async def test_a_burst_is_applied_whole_and_in_order_whatever_the_turn_budget(ctx, turn_budget_s):
    # 1e-6: every batch spends the budget, so the loop callback hands each remaining burst to the task, which
    # yields between turns: the two paths alternate and must not drop, repeat or reorder a batch
    async with _subscribed(ctx, turn_budget_s=turn_budget_s) as (idx, mgr, w):
        seq = await _chain(w, N)
        await until_async(lambda: mgr.stats("w").last_seq == seq, timeout=20)
        st = mgr.stats("w")
        assert st.gaps == 0 and st.restarts == 0
        assert idx.engine_hashes("w") == _reference(w).engine_hashes("w") == set(range(1, N + 1))
        assert idx.stats("w").skipped_unknown_parent == 0
        assert idx.overlap(block(0) + [0]) == {"w": 1}


async def test_plain_batches_are_applied_without_resuming_the_task_and_a_gap_still_goes_to_it(ctx, monkeypatch):
    # resuming the subscription's task for every batch (a Future, a task step and a second trip through the
    # selector) cost about as much as applying the batch at 10 batches/s per worker; the next batch in order
    # is applied from the loop's callback, anything else (here a gap) is still the task's `_on_message`
    on_message: list[int] = []
    async with _subscribed(ctx) as (idx, mgr, w):
        orig = mgr._on_message

        async def counting(sub: Any, frames: Any) -> None:
            on_message.append(1)
            await orig(sub, frames)

        monkeypatch.setattr(mgr, "_on_message", counting)
        before = len(on_message)
        seq = 0
        for i in range(50):  # one at a time: each one a wait and a wake-up
            seq = await w.publish([stored_event([i + 1], None if i == 0 else i, block(i), BS)])
            await until_async(lambda s=seq: mgr.stats("w").last_seq == s)
        assert len(on_message) == before, f"{len(on_message) - before} of 50 in-order batches went through the task"
        assert idx.engine_hashes("w") == set(range(1, 51))
        await w.publish([stored_event([51], 50, block(50), BS)], send=False)  # lost on the wire
        seq = await w.publish([stored_event([52], 51, block(51), BS)])
        await until_async(lambda: mgr.stats("w").last_seq == seq)
        assert len(on_message) == before + 1
        assert mgr.stats("w").gaps == 1 and idx.engine_hashes("w") == set()  # no replay endpoint: cleared


async def test_a_worker_over_its_pacing_budget_is_paused_even_when_applied_off_its_task(ctx):
    # the pace hook is charged for every batch, wherever it is applied, and a pause it asks for is kept: the
    # batches queued meanwhile wait for it, without the loop spinning on their descriptor, then are all applied
    charged: list[str] = []
    debt = [0.0]  # the next batch charged puts the worker this many seconds in debt

    def pace(worker: str, spent_s: float) -> float:
        charged.append(worker)
        pause, debt[0] = debt[0], 0.0
        return pause

    async with _subscribed(ctx, pace=pace) as (idx, mgr, w):
        n0 = len(charged)
        debt[0] = 0.4
        first = await w.publish([stored_event([1], None, block(0), BS)])
        await until_async(lambda: mgr.stats("w").last_seq == first)
        seq = await _chain(w, 5, first=2)
        await asyncio.sleep(0.05)
        cpu0 = time.process_time()
        await asyncio.sleep(0.2)
        # the SUB's descriptor stays readable while nobody reads the socket: the loop must not spin on it
        assert time.process_time() - cpu0 < 0.1, "the loop spun while the worker was paused"
        assert mgr.stats("w").last_seq == first, "a paused worker was read before its pause was over"
        await until_async(lambda: mgr.stats("w").last_seq == seq, timeout=5)
        assert idx.engine_hashes("w") == set(range(1, 7))
        assert len(charged) == n0 + 6


class _CountingSocket:
    """A subscription's socket shadow that counts its option reads (in pyzmq each is an enum lookup and a
    getsockopt, ~1.5 us; four of them per batch were 14% of a 1,000-worker shard's CPU) and its receives."""

    def __init__(self, sock: Any, counts: dict[str, int]) -> None:
        self._sock, self._counts = sock, counts

    def get(self, option: int) -> Any:
        self._counts["option reads"] += 1
        return self._sock.get(option)

    getsockopt = get

    def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
        frames = self._sock.recv_multipart(*args, **kwargs)
        self._counts["option reads"] += len(frames)  # pyzmq's reads RCVMORE after every frame
        return frames

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


async def test_a_batch_applied_on_its_wake_up_costs_three_option_reads(ctx):
    # the plain case at 10 batches/s per worker: one batch per wake-up. Reading both sockets' EVENTS before
    # and again after the batch, and RCVMORE after each of its three frames, was 7 option reads; the SUB's
    # readiness before and after, the monitor's once, and the frames' own "more" flag leave 3
    async with _subscribed(ctx) as (idx, mgr, w):
        (sub,) = mgr._subs["w"]
        counts = {"option reads": 0}
        sub.rx, sub.mon_rx = _CountingSocket(sub.rx, counts), _CountingSocket(sub.mon_rx, counts)
        n = 60
        for i in range(n):
            seq = await w.publish([stored_event([i + 1], None if i == 0 else i, block(i), BS)])
            await until_async(lambda s=seq: mgr.stats("w").last_seq == s)
        assert idx.engine_hashes("w") == set(range(1, n + 1))
        per_batch = counts["option reads"] / n
        assert per_batch < 3.5, f"{per_batch:.2f} option reads per batch"
