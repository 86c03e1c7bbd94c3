"""Asyncio ZeroMQ subscribers feeding a :class:`~kvindex.index.KvIndex`, one SUB socket per worker.

Each subscriber owns the worker's sequence bookkeeping: a gap means lost state (recover through replay when
the worker has a replay endpoint, otherwise clear the worker), a backwards jump means the publisher
restarted (clear and resync), and the first message after connecting warms the index up through replay when
possible.  A subscriber never dies on bad input: every failure is counted in the worker's stats and the loop
goes on.  Everything runs on the event loop; decoding/applying one batch is a bounded amount of CPU and long
replays yield to the loop every few batches so the request path keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio

from kvindex.decode import REPLAY_END_SEQ, decode_payload, encode_seq, split_live_frames, split_replay_frames
from kvindex.index import KvIndex, WorkerStats

log = logging.getLogger(__name__)

_YIELD_EVERY = 64


class _Sub:
    __slots__ = ("worker_id", "endpoint", "replay_endpoint", "sock", "task", "stats", "last_live", "applied")

    def __init__(self, worker_id: str, endpoint: str, replay_endpoint: str | None, stats: WorkerStats) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.sock: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None
        self.stats = stats
        self.last_live: int | None = None  # last seq seen on the SUB socket (restart detection)
        self.applied: int | None = None  # last seq applied from any source (gap detection, dedup)


class SubscriberManager:
    """Opens, runs and closes the per-worker subscribers."""

    def __init__(
        self,
        idx: KvIndex,
        topic: str = "",
        heartbeat_stale_s: float = 15.0,
        zmq_context: zmq.Context | None = None,
        *,
        replay_timeout_s: float = 2.0,
        replay_max_batches: int = 1_000_000,
    ) -> None:
        """``replay_timeout_s`` bounds the wait for each replay reply, so a dead replay endpoint costs a
        worker at most that long before it falls back to clearing."""
        self.idx = idx
        self.topic = topic.encode()
        self.heartbeat_stale_s = heartbeat_stale_s
        self.replay_timeout_s = replay_timeout_s
        self.replay_max_batches = replay_max_batches
        self._own_ctx = zmq_context is None
        if zmq_context is None:
            self._ctx = zmq.asyncio.Context()
        elif isinstance(zmq_context, zmq.asyncio.Context):
            self._ctx = zmq_context
        else:
            self._ctx = zmq.asyncio.Context.shadow(zmq_context.underlying)
        self._subs: dict[str, _Sub] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------- lifecycle
    async def add(self, worker_id: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Subscribe to a worker's KV events (re-adding replaces its endpoints and resets its entries)."""
        if self._closed:
            raise RuntimeError("SubscriberManager is closed")
        if worker_id in self._subs:
            await self.remove(worker_id)
        self.idx.add_worker(worker_id)
        sub = _Sub(worker_id, endpoint, replay_endpoint, self.idx.stats(worker_id))
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(endpoint)
        sub.sock = sock
        sub.task = asyncio.create_task(self._run(sub), name=f"kvindex-sub-{worker_id}")
        self._subs[worker_id] = sub
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="kvindex-stale-watchdog")

    async def remove(self, worker_id: str) -> None:
        """Close a worker's subscriber and drop its entries from the index."""
        sub = self._subs.pop(worker_id, None)
        if sub is not None:
            await self._stop(sub)
        self.idx.drop_worker(worker_id)

    async def close(self) -> None:
        """Close every subscriber (the index keeps its entries) and the context if we created it."""
        self._closed = True
        subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            await self._stop(sub)
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        if self._own_ctx:
            self._ctx.term()

    async def _stop(self, sub: _Sub) -> None:
        if sub.task is not None:
            sub.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sub.task
        if sub.sock is not None:
            sub.sock.close(linger=0)

    def resync(self, worker_id: str) -> None:
        """The worker's cache is known to be gone (its process died): drop its entries now, and treat its
        next message like a first connect (warm up through replay when it has a replay endpoint)."""
        self.idx.clear_worker(worker_id)
        sub = self._subs.get(worker_id)
        if sub is not None:
            sub.last_live = None
            sub.applied = None

    def workers(self) -> list[str]:
        """Workers with an open subscriber."""
        return list(self._subs)

    # -------------------------------------------------------------- staleness
    def check_stale(self, now: float | None = None) -> list[str]:
        """Mark heartbeating workers silent for longer than ``heartbeat_stale_s`` as stale; returns them."""
        now = time.monotonic() if now is None else now
        stale = []
        for wid, sub in self._subs.items():
            st = sub.stats
            last = st.last_message_monotonic
            if st.heartbeating and last is not None and now - last > self.heartbeat_stale_s:
                if not st.stale:
                    log.warning("kv events from %s silent for %.1fs: marking stale", wid, now - last)
                st.stale = True
                stale.append(wid)
        return stale

    async def _watch(self) -> None:
        period = max(0.05, min(1.0, self.heartbeat_stale_s / 4))
        while True:
            await asyncio.sleep(period)
            self.check_stale()

    # -------------------------------------------------------------- the loop
    async def _run(self, sub: _Sub) -> None:
        assert sub.sock is not None
        while True:
            try:
                frames = await sub.sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if sub.sock.closed:
                    return
                log.warning("kv events recv from %s failed: %s", sub.worker_id, exc)
                await asyncio.sleep(0.1)
                continue
            try:
                await self._on_message(sub, frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one message kill the subscriber
                log.exception("kv events from %s: unexpected failure handling a message", sub.worker_id)
                sub.stats.garbage_frames += 1

    def _apply(self, sub: _Sub, seq: int, payload: bytes) -> None:
        self.idx.apply_batch(sub.worker_id, decode_payload(payload))
        sub.applied = seq
        sub.stats.last_seq = seq

    async def _on_message(self, sub: _Sub, frames: list[bytes]) -> None:
        st = sub.stats
        st.last_message_monotonic = time.monotonic()
        st.stale = False
        parsed = split_live_frames(frames)
        if parsed is None:
            st.garbage_frames += 1
            return
        _, seq, payload = parsed
        first = sub.last_live is None
        restarted = not first and seq <= sub.last_live  # type: ignore[operator]
        sub.last_live = seq
        if first or restarted:
            if restarted:
                log.warning("kv events from %s: seq went back to %d, publisher restarted", sub.worker_id, seq)
                st.restarts += 1
                self.idx.clear_worker(sub.worker_id)
                sub.applied = None
            if sub.replay_endpoint:
                await self._warm_up(sub, seq, payload)
            else:
                self._apply(sub, seq, payload)
            return
        applied = sub.applied
        if applied is not None and seq <= applied:
            return  # already applied through replay
        if applied is not None and seq > applied + 1:
            st.gaps += 1
            log.warning("kv events from %s: gap %d..%d", sub.worker_id, applied + 1, seq - 1)
            if sub.replay_endpoint:
                await self._recover(sub, applied + 1, seq, payload)
                return
            self.idx.clear_worker(sub.worker_id)
        self._apply(sub, seq, payload)

    # ----------------------------------------------------------------- replay
    async def _replay(self, sub: _Sub, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the worker's replay ROUTER for every buffered batch with seq >= start; None on failure."""
        st = sub.stats
        st.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(sub.replay_endpoint)
            await dealer.send_multipart([b"", encode_seq(start)])
            out: list[tuple[int, bytes]] = []
            while len(out) < self.replay_max_batches:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                parsed = split_replay_frames(frames)
                if parsed is None:
                    st.garbage_frames += 1
                    continue
                if parsed[0] == REPLAY_END_SEQ:
                    break
                out.append(parsed)
            out.sort(key=lambda p: p[0])
            return out
        except (TimeoutError, zmq.ZMQError) as exc:
            st.replay_failures += 1
            log.warning("kv replay from %s (%s) failed: %r", sub.worker_id, sub.replay_endpoint, exc)
            return None
        finally:
            dealer.close(linger=0)

    async def _apply_replayed(self, sub: _Sub, batches: list[tuple[int, bytes]]) -> None:
        for n, (seq, payload) in enumerate(batches, 1):
            if sub.applied is None or seq > sub.applied:
                self._apply(sub, seq, payload)
            if n % _YIELD_EVERY == 0:
                await asyncio.sleep(0)

    async def _recover(self, sub: _Sub, start: int, live_seq: int, live_payload: bytes) -> None:
        batches = await self._replay(sub, start)
        if batches is None or not batches or batches[0][0] > start:
            # the missing batches are gone: whatever we index now lacks their effects
            if batches is not None:
                sub.stats.replay_lost += 1
            self.idx.clear_worker(sub.worker_id)
        await self._apply_replayed(sub, batches or [])
        if sub.applied is None or live_seq > sub.applied:
            self._apply(sub, live_seq, live_payload)

    async def _warm_up(self, sub: _Sub, live_seq: int, live_payload: bytes) -> None:
        """First message (or restart): rebuild from everything the replay buffer still holds."""
        batches = await self._replay(sub, 0)
        await self._apply_replayed(sub, batches or [])
        if sub.applied is None or live_seq > sub.applied:
            self._apply(sub, live_seq, live_payload)
