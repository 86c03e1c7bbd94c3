"""Asyncio ZeroMQ subscribers feeding a :class:`~kvindex.index.KvIndex`: one SUB socket per KV-event endpoint.

A worker has one endpoint, or one per data-parallel rank (each rank binds its own PUB at base port + rank and
numbers its batches on its own).  Each subscription owns its stream's sequence bookkeeping:

* **warm-up**: as soon as it connects (and again after the worker is known to have restarted), a subscription
  with a replay endpoint asks for everything from seq 0, so an idle worker's cache is visible without waiting
  for its next event (vLLM sends no heartbeats).  A warm-up that applied nothing is asked once more at the
  first live message: ZeroMQ registers a SUB at the PUB asynchronously, so a batch published right after
  the warm-up's answer can go to nobody, and nothing before the first live message shows it as a gap;
* **gap**: batches were lost.  With a replay endpoint the replay starts one batch *before* the gap, so the
  subscriber can check the publisher still has the history it applied (same payload digest); a different
  payload, a far jump (a ``time_ns`` start) or a replay that no longer holds the range means lost state
  (a restart): the rank is cleared, counted, and warmed up again.  Without replay the rank is cleared;
* **replay** must be contiguous up to the end marker: publishers keep ZeroMQ's default send high-water mark on
  their replay ROUTER, which drops frames in the middle (and the end marker) of a large replay.  A hole stops
  applying and the replay is asked again from the hole on a fresh socket, as long as each round makes progress
  (bounded rounds); a missing end marker without progress is a timeout, never a success.  A failed replay
  (not one over its budget) schedules a rebuild from 0 at the first message after a backoff
  (:data:`REWARM_MIN_S` doubling to :data:`REWARM_MAX_S`); what the rank holds stays until the publisher answers;
* **reset**: any reset (prober saw the worker die, restart, clear) bumps a generation number that every step
  of an in-flight replay checks after each await, so nothing stale is applied after a reset.

Nothing a publisher sends can cost more than the documented budgets: ``max_batch_bytes`` per message (also set
as the socket's ``ZMQ_MAXMSGSIZE``, so an oversized frame is refused by ZeroMQ before it is buffered whole),
``max_batch_events`` per batch, ``max_replay_bytes``/``replay_max_batches`` per replay, applied incrementally
(one batch in memory at a time); ingest yields to the event loop after ``turn_budget_s`` of work so request
handling keeps running during a flood, and what a flood costs shows as ``dropped_batches`` (gaps), not as
request latency.  A subscriber never dies on bad input: every failure is counted and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash
import zmq
import zmq.asyncio

from kvindex.aio import cancel_and_wait
from kvindex.decode import (
    REPLAY_END_SEQ,
    TOO_MANY_EVENTS,
    decode_payload,
    encode_seq,
    split_live_frames,
    split_replay_frames,
)
from kvindex.index import KvIndex

log = logging.getLogger(__name__)

FAR_JUMP = 1 << 32  # a seq this far past the last one is another numbering (a time_ns start): a restart
MAX_REPLAY_ROUNDS = 256  # replays re-asked from a hole (each must make progress) before giving up
MAX_REPLAY_CONFIRMS = 8  # rounds in a row that end on the end marker after batches before the live stream takes over
MAX_REPLAY_GARBAGE = 16  # malformed replay replies tolerated in one replay
GAP_WARN_INTERVAL_S = 10.0  # one gap warning per burst, not one per gap
STOP_TIMEOUT_S = 2.0  # a subscriber task that ignores its cancel this long has its socket closed under it
REWARM_MIN_S = 1.0  # after a failed replay the rank is rebuilt from 0 again after this long, doubling per failure
REWARM_MAX_S = 60.0


@dataclass(frozen=True, slots=True)
class KvSource:
    """One KV-event endpoint of a worker.  ``rank``: the data-parallel rank it publishes (None: one endpoint
    for the whole worker, the payload's ``data_parallel_rank`` is used, bounded by the index)."""

    endpoint: str
    replay_endpoint: str | None = None
    rank: int | None = None


@dataclass(slots=True)
class SubscriberStats:
    """Sequence and liveness counters of one subscription (the index counts what it did with the events)."""

    endpoint: str = ""
    rank: int | None = None
    last_seq: int | None = None
    messages: int = 0
    gaps: int = 0
    dropped_batches: int = 0  # batches lost on the wire (sum of gap sizes): what a flood costs
    replays: int = 0
    replay_lost: int = 0
    replay_failures: int = 0
    replay_holes: int = 0
    replay_ok: int = 0
    restarts: int = 0
    oversized: int = 0
    reconnects: int = 0
    heartbeating: bool = False
    stale: bool = False
    silent: bool = False
    connected_monotonic: float = field(default_factory=time.monotonic)
    last_message_monotonic: float | None = None


_SUMMED = ("messages", "gaps", "dropped_batches", "replays", "replay_lost", "replay_failures", "replay_holes",
           "replay_ok", "restarts", "oversized", "reconnects")


class _Reset(Exception):
    """Internal: the subscription was reset while a replay was in flight; what it fetched is stale."""


class _ReplayFailed(Exception):
    """Internal: a replay timed out, overran its budget or kept sending garbage.  ``retry``: worth asking
    again later (a budget overrun is not: the buffer would overrun it again)."""

    def __init__(self, why: str, retry: bool = True) -> None:
        super().__init__(why)
        self.retry = retry


class _Sub:
    __slots__ = ("worker_id", "source", "sock", "task", "monitor", "stats", "last_live", "applied", "digest", "gen",
                 "need_warm", "recheck", "rewarm_at", "rewarm_backoff", "gap_warned_at", "gaps_unwarned")

    def __init__(self, worker_id: str, source: KvSource) -> None:
        self.worker_id = worker_id
        self.source = source
        self.sock: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None
        self.monitor: asyncio.Task[None] | None = None
        self.stats = SubscriberStats(endpoint=source.endpoint, rank=source.rank)
        self.last_live: int | None = None  # last seq seen on the SUB socket (restart detection)
        self.applied: int | None = None  # last seq applied from any source (gap detection, dedup)
        self.digest = 0  # xxh3 of the payload applied at `applied`: is a replay the same history?
        self.gen = 0  # bumped by every reset; in-flight replays check it after each await
        self.need_warm = source.replay_endpoint is not None
        self.recheck = False  # the warm-up applied nothing: ask again from 0 at the first live message
        self.rewarm_at: float | None = None  # a replay failed: rebuild from 0 at the first message after this
        self.rewarm_backoff = 0.0
        self.gap_warned_at = -GAP_WARN_INTERVAL_S
        self.gaps_unwarned = 0

    @property
    def label(self) -> str:
        return self.worker_id if self.source.rank is None else f"{self.worker_id} rank {self.source.rank}"


class SubscriberManager:
    """Opens, runs and closes the subscriptions of every worker."""

    def __init__(
        self,
        idx: KvIndex,
        topic: str = "",
        heartbeat_stale_s: float = 15.0,
        zmq_context: zmq.Context | None = None,
        *,
        replay_timeout_s: float = 2.0,
        replay_max_batches: int = 1_000_000,
        max_batch_bytes: int = 16 * 1024 * 1024,
        max_batch_events: int = 16_384,
        max_replay_bytes: int = 512 * 1024 * 1024,
        turn_budget_s: float = 0.005,
        silent_after_s: float = 60.0,
        is_healthy: Callable[[str], bool] | None = None,
        registry: Any = None,
    ) -> None:
        """``replay_timeout_s`` bounds the wait for each replay reply, so a dead replay endpoint costs a
        subscription at most that long per round.  ``silent_after_s``: a subscription that has received
        nothing at all for this long while ``is_healthy(worker)`` says the worker is up (wrong port, wrong
        topic, or an idle engine without heartbeats) is logged once and flagged ``silent``."""
        self.idx = idx
        self.topic = topic.encode()
        self.heartbeat_stale_s = heartbeat_stale_s
        self.replay_timeout_s = replay_timeout_s
        self.replay_max_batches = replay_max_batches
        self.max_batch_bytes = max_batch_bytes
        self.max_batch_events = max_batch_events
        self.max_replay_bytes = max_replay_bytes
        self.turn_budget_s = turn_budget_s
        self.silent_after_s = silent_after_s
        self.is_healthy = is_healthy
        self._own_ctx = zmq_context is None
        if zmq_context is None:
            self._ctx = zmq.asyncio.Context()
        elif isinstance(zmq_context, zmq.asyncio.Context):
            self._ctx = zmq_context
        else:
            self._ctx = zmq.asyncio.Context.shadow(zmq_context.underlying)
        self._subs: dict[str, list[_Sub]] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False
        if registry is not None:
            from kvindex.metrics import register_subscribers

            register_subscribers(self.stats_snapshot, registry)

    # ------------------------------------------------------------- lifecycle
    async def add(
        self, worker_id: str, endpoint: str | Sequence[KvSource], replay_endpoint: str | None = None
    ) -> None:
        """Subscribe to a worker's KV events: one endpoint (with its optional replay endpoint) or one
        :class:`KvSource` per rank.  Re-adding replaces the worker's subscriptions and resets its entries."""
        if self._closed:
            raise RuntimeError("SubscriberManager is closed")
        sources = [KvSource(endpoint, replay_endpoint)] if isinstance(endpoint, str) else list(endpoint)
        if not sources:
            raise ValueError("a worker needs at least one KV-event endpoint")
        if worker_id in self._subs:
            await self.remove(worker_id)
        self.idx.add_worker(worker_id)
        ranked = [s.rank for s in sources if s.rank is not None]
        if ranked:
            self.idx.set_ranks(worker_id, max(ranked) + 1)
        subs = []
        for source in sources:
            sub = _Sub(worker_id, source)
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_batch_bytes + 4096)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(source.endpoint)
            sub.sock = sock
            sub.task = asyncio.create_task(self._run(sub), name=f"kvindex-sub-{sub.label}")
            sub.monitor = asyncio.create_task(self._reconnect_on_disconnect(sub, mon),
                                              name=f"kvindex-mon-{sub.label}")
            subs.append(sub)
        self._subs[worker_id] = subs
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="kvindex-stale-watchdog")

    async def remove(self, worker_id: str) -> None:
        """Close a worker's subscriptions and drop its entries from the index."""
        for sub in self._subs.pop(worker_id, []):
            await self._stop(sub)
        self.idx.drop_worker(worker_id)

    async def close(self) -> None:
        """Close every subscription (the index keeps its entries) and the context if we created it."""
        self._closed = True
        subs, self._subs = [s for ss in self._subs.values() for s in ss], {}
        for sub in subs:
            await self._stop(sub)
        await cancel_and_wait([self._watchdog])
        self._watchdog = None
        if self._own_ctx:
            self._ctx.term()

    async def _stop(self, sub: _Sub) -> None:
        sub.gen += 1
        if await cancel_and_wait((sub.task, sub.monitor), STOP_TIMEOUT_S):
            log.error("kv subscriber of %s did not stop on cancel: closing its socket under it", sub.label)
        if sub.sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sub.sock.disable_monitor()
            sub.sock.close(linger=0)

    async def _reconnect_on_disconnect(self, sub: _Sub, mon: zmq.asyncio.Socket) -> None:
        """libzmq does not reconnect a SUB whose peer it dropped for exceeding ZMQ_MAXMSGSIZE: reconnect it
        ourselves, so an oversized frame costs one lost batch (a gap, healed as usual), not the stream."""
        try:
            while True:
                await mon.recv_multipart()
                sock = sub.sock
                if sock is None or sock.closed:
                    return
                sub.stats.reconnects += 1
                with contextlib.suppress(zmq.ZMQError):
                    sock.disconnect(sub.source.endpoint)
                sock.connect(sub.source.endpoint)
                await asyncio.sleep(0.05)  # a peer that keeps being dropped is not reconnected in a tight loop
        finally:
            mon.close(linger=0)

    def resync(self, worker_id: str) -> None:
        """The worker's cache is known to be gone (its process died): drop its entries now, invalidate any
        replay in flight, and warm up again (replay from 0) with its next message."""
        self.idx.clear_worker(worker_id)
        for sub in self._subs.get(worker_id, []):
            self._reset(sub)

    def _reset(self, sub: _Sub) -> None:
        sub.gen += 1
        sub.last_live = None
        sub.applied = None
        sub.digest = 0
        sub.need_warm = sub.source.replay_endpoint is not None
        sub.rewarm_at = None
        sub.rewarm_backoff = 0.0

    def _clear(self, sub: _Sub) -> None:
        """This stream lost state: clear what it fed (its rank, or the whole worker for a rank-less endpoint)."""
        self.idx.clear_worker(sub.worker_id, sub.source.rank)

    def workers(self) -> list[str]:
        """Workers with open subscriptions."""
        return list(self._subs)

    def stats(self, worker_id: str, rank: int | None = None) -> SubscriberStats:
        """One subscription's counters: the worker's first one, or the one of ``rank``."""
        for sub in self._subs.get(worker_id, []):
            if rank is None or sub.source.rank == rank:
                return sub.stats
        raise KeyError(worker_id)

    def stats_snapshot(self) -> dict[str, dict[str, Any]]:
        """Per worker: counters summed over its subscriptions, flags ORed, ``last_seq`` of the first one, and
        the per-rank detail under ``kv_endpoints`` (JSON-able, for ``/debug/kv`` and the metrics)."""
        out: dict[str, dict[str, Any]] = {}
        for wid, subs in self._subs.items():
            d: dict[str, Any] = {k: sum(getattr(s.stats, k) for s in subs) for k in _SUMMED}
            d["last_seq"] = subs[0].stats.last_seq
            for flag in ("heartbeating", "stale", "silent"):
                d[flag] = any(getattr(s.stats, flag) for s in subs)
            d["kv_endpoints"] = [asdict(s.stats) for s in subs]
            out[wid] = d
        return out

    # -------------------------------------------------------------- staleness
    def check_stale(self, now: float | None = None) -> list[str]:
        """Mark heartbeating workers silent for longer than ``heartbeat_stale_s`` as stale; returns them.  Also
        flags (and logs once) subscriptions that never received anything from a worker that is up."""
        now = time.monotonic() if now is None else now
        stale = []
        for wid, subs in self._subs.items():
            for sub in subs:
                st = sub.stats
                last = st.last_message_monotonic
                if st.heartbeating and last is not None and now - last > self.heartbeat_stale_s:
                    if not st.stale:
                        log.warning("kv events from %s silent for %.1fs: marking stale", sub.label, now - last)
                    st.stale = True
                    if wid not in stale:
                        stale.append(wid)
                self._check_silent(sub, now)
        return stale

    def _check_silent(self, sub: _Sub, now: float) -> None:
        st = sub.stats
        if st.silent or st.messages or st.replay_ok or now - st.connected_monotonic < self.silent_after_s:
            return
        if self.is_healthy is not None and not self.is_healthy(sub.worker_id):
            return
        st.silent = True
        log.warning(
            "no KV events from %s on %s (topic %r) for %.0fs although the worker answers its health probe: "
            "wrong port or topic, or an idle engine that sends no heartbeats (vLLM); its cache is invisible "
            "to routing until it publishes", sub.label, sub.source.endpoint, self.topic.decode(errors="replace"),
            now - st.connected_monotonic,
        )

    async def _watch(self) -> None:
        period = max(0.05, min(1.0, self.heartbeat_stale_s / 4))
        while True:
            await asyncio.sleep(period)
            self.check_stale()

    # -------------------------------------------------------------- the loop
    async def _run(self, sub: _Sub) -> None:
        assert sub.sock is not None
        turn = time.perf_counter()
        while True:
            try:
                if sub.need_warm:
                    await self._warm_up(sub)
                frames = await sub.sock.recv_multipart(copy=True)
                await self._on_message(sub, frames)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if sub.sock.closed:
                    return
                log.warning("kv events recv from %s failed: %s", sub.label, exc)
                await asyncio.sleep(0.1)
            except _Reset:
                continue
            except Exception:  # never let one message kill the subscriber
                log.exception("kv events from %s: unexpected failure handling a message", sub.label)
                self.idx.count_garbage_frames(sub.worker_id)
            # a queued message is returned without yielding: bound the work done per loop turn
            now = time.perf_counter()
            if now - turn > self.turn_budget_s:
                await asyncio.sleep(0)
                turn = time.perf_counter()

    def _apply(self, sub: _Sub, seq: int, payload: bytes) -> None:
        batch = decode_payload(payload, self.max_batch_events)
        if batch.reason == TOO_MANY_EVENTS:
            sub.stats.oversized += 1
            self._clear(sub)  # its effects are unknown: whatever the rank held may be wrong now
            log.warning("kv batch %d from %s has %d events (budget %d): refused, rank cleared", seq, sub.label,
                        batch.raw_event_count, self.max_batch_events)
        else:
            if batch.heartbeat:
                sub.stats.heartbeating = True
            self.idx.apply_batch(sub.worker_id, batch, sub.source.rank)
        sub.applied = seq
        sub.digest = xxhash.xxh3_64_intdigest(payload)
        sub.stats.last_seq = seq

    def _warn_gap(self, sub: _Sub, first: int, last: int) -> None:
        now = time.monotonic()
        if now - sub.gap_warned_at >= GAP_WARN_INTERVAL_S:
            more = f" (+{sub.gaps_unwarned} more gaps since the last warning)" if sub.gaps_unwarned else ""
            log.warning("kv events from %s: gap %d..%d%s", sub.label, first, last, more)
            sub.gap_warned_at = now
            sub.gaps_unwarned = 0
        else:
            sub.gaps_unwarned += 1

    async def _on_message(self, sub: _Sub, frames: list[bytes]) -> None:
        st = sub.stats
        st.last_message_monotonic = time.monotonic()
        st.messages += 1
        st.stale = False
        st.silent = False
        parsed = split_live_frames(frames)
        if parsed is None:
            self.idx.count_garbage_frames(sub.worker_id)
            return
        _, seq, payload = parsed
        last_live = sub.last_live
        sub.last_live = seq
        if sub.recheck and sub.applied is None:
            # Nothing was applied yet, so nothing tells whether batches came before this one: those published
            # between the warm-up's answer and the moment the PUB registered this SUB went to nobody.
            await self._warm_up(sub, recheck=False)  # raises _Reset if the worker was reset meanwhile
        elif sub.rewarm_at is not None and st.last_message_monotonic >= sub.rewarm_at:
            log.info("kv events from %s: rebuilding from the replay buffer after a failed replay", sub.label)
            await self._warm_up(sub, recheck=False, keep=True)
        applied = sub.applied
        if last_live is not None and seq <= last_live:
            self._restart(sub, f"seq went back to {seq}")
        elif applied is not None and seq <= applied:
            return  # already applied through replay
        elif applied is not None and seq > applied + 1:
            st.gaps += 1
            st.dropped_batches += seq - applied - 1
            self._warn_gap(sub, applied + 1, seq - 1)
            if seq - applied > FAR_JUMP:
                self._restart(sub, f"seq jumped from {applied} to {seq}")
            elif sub.source.replay_endpoint and sub.rewarm_at is None:
                # (while a rebuild is pending the endpoint just failed: clear, and let the rebuild bring it back)
                await self._recover(sub, applied)  # raises _Reset if the worker was reset meanwhile
                if sub.applied is not None and seq <= sub.applied:
                    return
                if sub.applied is not None and seq > sub.applied + 1:
                    self._clear(sub)  # the replay did not reach this batch: its predecessors are lost
            else:
                self._clear(sub)
        if sub.need_warm:
            await self._warm_up(sub)
            if sub.applied is not None and seq <= sub.applied:
                return
        self._apply(sub, seq, payload)

    def _restart(self, sub: _Sub, why: str) -> None:
        log.warning("kv events from %s: %s, publisher restarted", sub.label, why)
        sub.stats.restarts += 1
        self._clear(sub)
        last_live = sub.last_live
        self._reset(sub)
        sub.last_live = last_live

    # ----------------------------------------------------------------- replay
    async def _recover(self, sub: _Sub, applied: int) -> None:
        """Gap after ``applied``: replay from ``applied`` itself, so the first reply proves (same digest) that
        the publisher still has the history we applied; otherwise the rank lost state and is warmed again."""
        digest = sub.digest
        first: list[int] = []

        def check(seq: int, payload: bytes) -> bool:
            if not first:
                first.append(seq)
                if seq == applied:
                    if xxhash.xxh3_64_intdigest(payload) != digest:
                        raise _Restarted
                    return False  # already applied: only the proof
                if seq > applied + 1:
                    sub.stats.replay_lost += 1
                    log.warning("kv replay from %s starts at %d: batches %d..%d are gone, rank cleared",
                                sub.label, seq, applied + 1, seq - 1)
                    self._clear(sub)
                    sub.applied = seq - 1
            return True

        try:
            ok = await self._replay(sub, applied, check)
        except _Restarted:
            self._restart(sub, f"replayed batch {applied} differs from the one applied")
            await self._warm_up(sub)
            return
        if not ok:
            self._clear(sub)
        elif not first:
            sub.stats.replay_lost += 1
            self._clear(sub)

    async def _warm_up(self, sub: _Sub, recheck: bool = True, keep: bool = False) -> None:
        """Rebuild the rank from everything the publisher's replay buffer still holds: on connect, restart or
        reset (the rank is empty), or after an earlier replay failed (``keep``: what the rank holds stays
        until the publisher answers, which may still be down; its first reply clears it, then the whole
        buffer is applied in order and the live stream goes on from its end).

        A warm-up that applies nothing (a fresh engine's empty buffer, or a replay that failed) is asked once
        more at the first live message (``recheck``): ZeroMQ registers a SUB at the PUB asynchronously, so a
        batch published just after the warm-up's answer can be lost on the wire with no gap to show it."""
        sub.need_warm = False
        sub.recheck = False
        sub.rewarm_at = None  # a failure below schedules the next one
        cleared = not keep
        if not keep:
            sub.applied = None

        def accept(seq: int, payload: bytes) -> bool:
            nonlocal cleared
            if not cleared:
                cleared = True
                self._clear(sub)
                sub.applied = None
            return True

        if await self._replay(sub, 0, accept):
            sub.rewarm_backoff = 0.0
        elif cleared:
            self._clear(sub)  # none or part of the buffer came: the live stream starts the history again
            sub.applied = None
        sub.recheck = recheck and sub.applied is None

    async def _replay(self, sub: _Sub, start: int, accept: Callable[[int, bytes], bool]) -> bool:
        """Ask for every buffered batch with seq >= ``start`` and apply them as they arrive, contiguously.

        A hole (frames dropped at the publisher's send HWM), or a timeout after progress (the end marker is
        dropped too), stops applying and the replay is asked again from there on a fresh socket, as long as each
        round makes progress, at most :data:`MAX_REPLAY_ROUNDS` times, within one batch/byte budget.  ``accept(seq, payload)`` sees each
        first reply (False: do not apply it).  True when the stream is contiguous up to the end marker; False
        after a failure (counted), with whatever contiguous prefix was applied kept.  Raises :class:`_Reset` if
        the subscription was reset meanwhile."""
        st = sub.stats
        gen = sub.gen
        ask = start
        spent = [0, 0]  # batches and bytes received over every round: the budget is per replay
        confirms = 0
        for rnd in range(MAX_REPLAY_ROUNDS):
            st.replays += 1
            try:
                hole = await self._replay_round(sub, ask, rnd == 0, accept, gen, spent)
            except _ReplayFailed as exc:
                st.replay_failures += 1
                log.warning("kv replay from %s (%s) failed: %s%s", sub.label, sub.source.replay_endpoint, exc,
                            self._schedule_rewarm(sub) if exc.retry else "")
                return False
            if hole is None:
                st.replay_ok += 1
                return True
            if isinstance(hole, _Confirm):
                # the end marker came after batches: a tail dropped at the send HWM looks just like that, so
                # ask once more from the next seq and finish only on a bare end marker.  A publisher busy
                # enough to answer every confirmation with new batches is followed by its live stream, whose
                # gaps are recovered like any other.
                confirms += 1
                if confirms > MAX_REPLAY_CONFIRMS:
                    st.replay_ok += 1
                    return True
                ask = int(hole)
                continue
            confirms = 0
            if rnd and hole == ask:
                st.replay_failures += 1
                log.warning("kv replay from %s made no progress past seq %d: rank cleared%s", sub.label, hole,
                            self._schedule_rewarm(sub))
                return False
            st.replay_holes += 1
            (log.warning if rnd == 0 else log.debug)(
                "kv replay from %s has a hole at seq %d (frames dropped by the publisher): asking again from "
                "there", sub.label, hole)
            ask = hole
        st.replay_failures += 1
        log.warning("kv replay from %s still had holes after %d rounds: rank cleared%s", sub.label,
                    MAX_REPLAY_ROUNDS, self._schedule_rewarm(sub))
        return False

    def _schedule_rewarm(self, sub: _Sub) -> str:
        """A replay failed, so the rank misses whatever it was to bring: rebuild it from 0 later, backing off
        (a dead replay endpoint stalls the subscription ``replay_timeout_s`` per attempt).  Returns the words
        for the log line."""
        sub.rewarm_backoff = min(REWARM_MAX_S, sub.rewarm_backoff * 2 if sub.rewarm_backoff else REWARM_MIN_S)
        sub.rewarm_at = time.monotonic() + sub.rewarm_backoff
        return f"; rebuilding from the replay buffer again in {sub.rewarm_backoff:.0f}s"

    async def _replay_round(
        self, sub: _Sub, ask: int, initial: bool, accept: Callable[[int, bytes], bool], gen: int, spent: list[int]
    ) -> int | None:
        """One replay request; returns the seq of the first hole, a :class:`_Confirm` of the next seq when the
        end marker followed batches (the tail may have been dropped), or None for a bare end marker.
        The first round lets ``accept`` judge its first reply (where the buffer starts); a round re-asked from
        a hole must start exactly there."""
        expected = ask
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_batch_bytes + 4096)
        first_reply = True
        garbage = 0
        received = 0
        turn = time.perf_counter()
        try:
            dealer.connect(sub.source.replay_endpoint)  # type: ignore[arg-type]
            await dealer.send_multipart([b"", encode_seq(ask)])
            while True:
                try:
                    async with asyncio.timeout(self.replay_timeout_s):
                        frames = await dealer.recv_multipart(copy=True)
                except TimeoutError:
                    if received and sub.gen == gen:
                        # the end marker is the frame a full send HWM drops first: ask again from where the
                        # contiguous part ended (a re-ask past the newest batch answers the end marker alone)
                        return expected
                    raise _ReplayFailed("no end marker within the timeout") from None
                except zmq.ZMQError as exc:
                    raise _ReplayFailed(repr(exc)) from None
                if sub.gen != gen:
                    raise _Reset
                parsed = split_replay_frames(frames)
                if parsed is None:
                    self.idx.count_garbage_frames(sub.worker_id)
                    garbage += 1
                    if garbage > MAX_REPLAY_GARBAGE:
                        raise _ReplayFailed("too many malformed replies")
                    continue
                seq, payload = parsed
                if seq == REPLAY_END_SEQ:
                    return _Confirm(expected) if received else None
                received += 1
                spent[0] += 1
                spent[1] += len(payload)
                if spent[0] > self.replay_max_batches or spent[1] > self.max_replay_bytes:
                    sub.stats.oversized += 1
                    raise _ReplayFailed("replay over its batch/byte budget", retry=False)
                if first_reply:
                    first_reply = False
                    if initial:
                        expected = seq + 1
                        if not accept(seq, payload):
                            continue
                    elif seq != expected:
                        # a send-HWM drop never takes the first frame of a burst: the batch is gone for good
                        sub.stats.replay_lost += 1
                        log.warning("kv replay from %s no longer holds batch %d: rank cleared", sub.label, expected)
                        self._clear(sub)
                        sub.applied = seq - 1
                elif seq < expected:
                    continue  # a duplicate
                elif seq > expected:
                    return expected  # a hole: ask again from it on a fresh socket (the rest goes nowhere)
                expected = seq + 1
                if sub.applied is None or seq > sub.applied:
                    self._apply(sub, seq, payload)
                now = time.perf_counter()
                if now - turn > self.turn_budget_s:
                    await asyncio.sleep(0)
                    turn = time.perf_counter()
                    if sub.gen != gen:
                        raise _Reset
        finally:
            dealer.close(linger=0)


class _Confirm(int):
    """Internal: the seq to ask from to prove that a replay's end marker was not preceded by a dropped tail."""


class _Restarted(Exception):
    """Internal: the replayed history differs from the one applied (another process)."""
