"""Asyncio ZeroMQ subscribers feeding a :class:`~kvindex.index.KvIndex`: one SUB socket per KV-event endpoint.

This module is the socket lifecycle (connect, reconnect after a dropped peer, the SUB sockets, the receive
loop, staleness) and the live stream's sequence bookkeeping; the replay protocol (its DEALER sockets, rounds,
completion rule and rewarm) is `kvindex/replay.py`, and a subscription's state `kvindex/subscription.py`.
What others import (`SubscriberManager`, `KvSource`, `SubscriberStats`, the replay limits) is exported here.

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
  (bounded rounds); a missing end marker without progress is a timeout, never a success; it is complete at a
  bare end marker or once it reaches the first live seq minus one.  A failed replay (not one over its budget)
  schedules a rebuild from 0 on its own timer, message or not (vLLM's idle engine sends nothing), after a
  backoff (:data:`REWARM_MIN_S` doubling to :data:`REWARM_MAX_S`, on the house's
  :class:`~kvindex.backoff.Backoff`); what the rank holds stays until the publisher answers;
* **reconnect**: when the SUB's peer goes away the SUB is recreated, never disconnected and reconnected
  (libzmq keeps a prefetched first frame of a queued message and glues the next peer's first message to it,
  or aborts on ``!_more`` in fq.cpp when the rest of that message is gone); with a replay endpoint the
  history is then verified by a replay from the last applied batch, and a malformed first message after a
  reconnect is taken as a restart;
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
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import xxhash
import zmq
import zmq.asyncio

from kvindex.aio import cancel_and_wait
from kvindex.backoff import Backoff
from kvindex.decode import TOO_MANY_EVENTS, decode_payload, decode_storage_payload, split_live_frames
from kvindex.index import KvIndex
from kvindex.replay import (
    MAX_REPLAY_CONFIRMS,
    MAX_REPLAY_GARBAGE,
    MAX_REPLAY_ROUNDS,
    REWARM_MAX_S,
    REWARM_MIN_S,
    Replayer,
)
from kvindex.subscription import GAP_WARN_INTERVAL_S, KvSource, Reset, SubscriberStats, Subscription

__all__ = ["DEFAULT_ZMQ_MAX_SOCKETS", "FAR_JUMP", "GAP_WARN_INTERVAL_S", "MAX_REPLAY_CONFIRMS", "MAX_REPLAY_GARBAGE", "MAX_REPLAY_ROUNDS",
           "REWARM_MAX_S", "REWARM_MIN_S", "STOP_TIMEOUT_S", "KvSource", "SubscriberManager", "SubscriberStats",
           "raise_socket_limit", "socket_budget"]

log = logging.getLogger(__name__)

FAR_JUMP = 1 << 32  # a seq this far past the last one is another numbering (a time_ns start): a restart
REFUSED_RETRY_S = 5.0  # a subscription refused for want of a socket is tried again this often
STOP_TIMEOUT_S = 2.0  # a subscriber task that ignores its cancel this long has its socket closed under it
# REWARM_MIN_S / REWARM_MAX_S (kvindex/replay.py) are read from this module when a subscription is made
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # ints: no enum work per message
DEFAULT_ZMQ_MAX_SOCKETS = 1023  # libzmq's ZMQ_MAX_SOCKETS default per context (ZMQ_MAX_SOCKETS_DFLT, zmq.h)
FDS_PER_SOCKET = 2  # a socket holds its mailbox (an eventfd) and, for a SUB or DEALER, its TCP connection


def _recv_frames(sock: zmq.Socket) -> list[bytes]:
    """``sock.recv_multipart(NOBLOCK)`` without its overhead: pyzmq's reads the ``RCVMORE`` option after every
    frame (an enum lookup in each option read) and evaluates a `typing.cast` of a subscripted ``Union`` per call;
    a frame received without a copy says itself whether another follows. With the wake path's fewer ``EVENTS``
    reads, a batch's plain path costs 36-37 us against 42-44 (`python -m bench.bench_wake_path`,
    `bench/results/ingest_apart-stop61/wake_path.txt`). Raises `zmq.Again` when nothing is queued; the frames of
    a message after its first are never missing (libzmq delivers a message whole)."""
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


def _done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def socket_budget(nofile: int | None = None) -> int:
    """The most ZeroMQ sockets this process can hold open: ``RLIMIT_NOFILE`` (soft; or ``nofile``) over the
    file descriptors a socket holds, never below libzmq's own default.

    A subscription holds a SUB, its disconnect monitor and the monitor's inproc peer (three sockets, about
    four descriptors), plus a DEALER while it replays: libzmq's default of 1,023 sockets per context stops a
    picker near 340 workers with ``EMFILE`` ("Too many open files") although ``ulimit -n`` allows far more.
    Past the descriptor limit a larger slot table buys nothing: the OS refuses the socket instead."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if nofile == resource.RLIM_INFINITY:
            nofile = 1 << 20
    return max(DEFAULT_ZMQ_MAX_SOCKETS, nofile // FDS_PER_SOCKET)


def raise_socket_limit(ctx: zmq.Context, nofile: int | None = None) -> int:
    """Raise ``ctx``'s ZMQ_MAX_SOCKETS to :func:`socket_budget` (within libzmq's ZMQ_SOCKET_LIMIT); returns
    the value set. libzmq sizes its socket table when the context's first socket is made, so this must run
    before that (callers create the context and call this at once); later it changes nothing."""
    want = min(socket_budget(nofile), ctx.get(zmq.SOCKET_LIMIT))
    if want > ctx.get(zmq.MAX_SOCKETS):
        ctx.set(zmq.MAX_SOCKETS, want)
    return int(ctx.get(zmq.MAX_SOCKETS))


_SUMMED = ("messages", "gaps", "dropped_batches", "replays", "replay_lost", "replay_failures", "replay_holes",
           "replay_ok", "restarts", "oversized", "reconnects")


# `check_stale` lets `between_batches` run (an ingest shard answers its waiting lookups there) after this many
# workers: the whole check walks every subscription, about 1 us each
CHECK_POLL_EVERY = 64


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
        pace: Callable[[str, float], float] | None = None,
        between_batches: Callable[[], None] | None = None,
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
        # pace(worker, seconds its message took) -> seconds to wait before reading its next one (a per-worker
        # CPU budget, epp_extproc/ingest/pacing.py); None: no budget beyond the turn budget
        self.pace = pace
        # called after every applied batch, live or replayed: an ingest shard answers the lookups waiting on
        # its socket there, so a lookup waits at most one batch's apply (epp_extproc/ingest/server.py)
        self.between_batches = between_batches
        self._own_ctx = zmq_context is None
        if zmq_context is None:
            self._ctx = zmq.asyncio.Context()
            raise_socket_limit(self._ctx)  # before its first socket: libzmq sizes the table then
        elif isinstance(zmq_context, zmq.asyncio.Context):
            self._ctx = zmq_context
        else:
            self._ctx = zmq.asyncio.Context.shadow(zmq_context.underlying)
        self._replayer = Replayer(self._ctx, idx, apply=self._apply, clear=self._clear, restart=self._restart,
                                  peek=self._peek, replay_timeout_s=replay_timeout_s, replay_max_batches=replay_max_batches,
                                  max_batch_bytes=max_batch_bytes, max_replay_bytes=max_replay_bytes,
                                  turn_budget_s=turn_budget_s)
        self._subs: dict[str, list[Subscription]] = {}
        # workers whose sockets could not be opened (the socket or descriptor limit): why, and their sources,
        # retried by the watchdog; they route by load meanwhile
        self._refused: dict[str, tuple[str, list[KvSource]]] = {}
        self.refused_total = 0  # subscriptions refused for want of a socket, retries included
        self._refusal_logged = False
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False
        if registry is not None:
            from kvindex.metrics import register_subscribers

            register_subscribers(self.stats_snapshot, registry, totals=self.stats_totals)

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
        if worker_id in self._subs or worker_id in self._refused:
            await self.remove(worker_id)
        self.idx.add_worker(worker_id)
        ranked = [s.rank for s in sources if s.rank is not None]
        if ranked:
            self.idx.set_ranks(worker_id, max(ranked) + 1)
        self._subscribe(worker_id, sources)
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="kvindex-stale-watchdog")

    def _subscribe(self, worker_id: str, sources: list[KvSource]) -> bool:
        """Open every source's sockets and start their loops, or none: a socket refused (ZeroMQ's socket limit,
        the descriptor limit) is a fact about this process, not an error of the caller's, so it is counted,
        logged once, shown in the worker's stats (``subscribe_error``) and retried by the watchdog; the worker
        routes by load until then."""
        subs: list[Subscription] = []
        try:
            for source in sources:
                sub = Subscription(worker_id, source, Backoff(REWARM_MIN_S, REWARM_MAX_S))
                self._open_socket(sub)
                subs.append(sub)
        except zmq.ZMQError as exc:
            for sub in subs:
                self._close_socket(sub)
            self._refuse(worker_id, sources, exc)
            return False
        self._refused.pop(worker_id, None)
        for sub in subs:
            sub.task = asyncio.create_task(self._run(sub), name=f"kvindex-sub-{sub.label}")
        self._subs[worker_id] = subs
        return True

    def _refuse(self, worker_id: str, sources: list[KvSource], exc: zmq.ZMQError) -> None:
        limit = self._ctx.get(zmq.MAX_SOCKETS)
        why = f"cannot open its ZeroMQ sockets: {exc} (ZMQ_MAX_SOCKETS {limit}, RLIMIT_NOFILE " \
              f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
        self._refused[worker_id] = (why, sources)
        self.refused_total += 1
        if not self._refusal_logged:
            self._refusal_logged = True
            log.error("kv events of %s not subscribed: %s; it routes by load until a socket frees (retried "
                      "every few seconds; further refusals are counted in /debug/kv, not logged). Raise "
                      "`ulimit -n`, or use --kv-ingest apart with more --kv-ingest-shards", worker_id, why)

    async def remove(self, worker_id: str) -> None:
        """Close a worker's subscriptions and drop its entries from the index."""
        self._refused.pop(worker_id, None)
        for sub in self._subs.pop(worker_id, []):
            await self._stop(sub)
        self.idx.drop_worker(worker_id)

    async def close(self) -> None:
        """Close every subscription (the index keeps its entries) and the context if we created it."""
        self._closed = True
        self._refused.clear()
        subs, self._subs = [s for ss in self._subs.values() for s in ss], {}
        for sub in subs:
            await self._stop(sub)
        await cancel_and_wait([self._watchdog])
        self._watchdog = None
        if self._own_ctx:
            self._ctx.term()

    async def _stop(self, sub: Subscription) -> None:
        sub.gen += 1
        if await cancel_and_wait((sub.task,), STOP_TIMEOUT_S):
            log.error("kv subscriber of %s did not stop on cancel: closing its socket under it", sub.label)
        self._close_socket(sub)

    def _open_socket(self, sub: Subscription) -> None:
        """A SUB (with its disconnect monitor) connected to the subscription's endpoint, both watched by the
        event loop directly (see `_wait`)."""
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_batch_bytes + 4096)
            # a storage stream's socket carries nothing else; its topic (`kv@SHARED_STORAGE@<model>`) names no
            # worker, so the GPU streams' topic filter is not applied to it
            sock.setsockopt(zmq.SUBSCRIBE, b"" if sub.source.storage else self.topic)
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError:  # the monitor's sockets were refused: give the SUB's slot back
            sock.close(linger=0)
            raise
        sock.connect(sub.source.endpoint)
        # Both are read through plain (synchronous) shadows, never through their asyncio wrappers: a receive
        # through zmq.asyncio builds a Future and its bookkeeping for every message, even a non-blocking one,
        # and its Poller re-registers both descriptors on every wait; at 10 batches/s per worker nearly every
        # message is such a wait, and that machinery cost more CPU than decoding and applying the batch. The
        # descriptors are registered with the loop once, here, and unregistered before the sockets close.
        sub.sock, sub.monitor = sock, mon
        sub.rx, sub.mon_rx = zmq.Socket.shadow(sock.underlying), zmq.Socket.shadow(mon.underlying)
        sub.loop = asyncio.get_running_loop()
        sub.fds = (sub.rx.get(zmq.FD), sub.mon_rx.get(zmq.FD))
        for fd in sub.fds:
            sub.loop.add_reader(fd, self._wake, sub)

    def _close_socket(self, sub: Subscription) -> None:
        if sub.loop is not None and not sub.loop.is_closed():
            for fd in sub.fds:  # before the sockets close: a descriptor number is reused at once
                sub.loop.remove_reader(fd)
        sub.fds = ()
        sub.rx = sub.mon_rx = None
        if sub.waiter is not None and not sub.waiter.done():
            sub.waiter.set_result(None)  # the task (if it still runs) finds the socket closed
        sub.waiter = None
        if sub.sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sub.sock.disable_monitor()
            sub.sock.close(linger=0)
        if sub.monitor is not None:
            sub.monitor.close(linger=0)

    def _wake(self, sub: Subscription) -> None:
        """The loop saw a socket's descriptor readable. libzmq's descriptor is a signal that its state may
        have changed, and it stays readable until the socket processes its commands: reading ``EVENTS``
        does that (else the loop would call this again on every turn while the subscription is busy or
        paced). A subscription waiting for its next live batch has it applied right here when it is the
        plain case (`_apply_ready`); anything else wakes the subscription's task to handle it."""
        rx, mon = sub.rx, sub.mon_rx
        if rx is None or mon is None:
            return
        try:
            ready = rx.get(_EVENTS) & _POLLIN and not mon.get(_EVENTS) & _POLLIN
        except zmq.ZMQError:
            ready = False  # the task finds out why
        w = sub.waiter
        if w is None or w.done():
            return  # the task is busy (it reads the socket itself next) or gone
        if ready and self._apply_ready(sub):
            return  # nothing left for the task: it sleeps on, its waiter still set
        sub.waiter = None
        w.set_result(None)

    def _apply_ready(self, sub: Subscription) -> bool:
        """Apply the live batches queued on an idle subscription's SUB here, in the loop's callback, while
        each is the plain case: the next batch in order, with no warm-up, replay, rebuild, reconnect or
        pending message in the way. What `_run` would do with them, without resuming its task per batch,
        which at 10 batches/s per worker (one batch per wake-up) cost about as much as applying it.

        True: the queue is empty and the task may sleep on. False: the task must run: a message it must
        handle itself is in ``sub.pending``, a pause is due (``sub.pause``), the turn budget is spent with
        batches still queued, the monitor saw the peer go, or the socket failed."""
        rx, mon = sub.rx, sub.mon_rx
        assert rx is not None and mon is not None
        turn = time.perf_counter()
        try:
            while True:
                if sub.need_warm or sub.verify or sub.rewarm_at is not None or sub.reconnected:
                    return False
                try:
                    frames = _recv_frames(rx)
                except zmq.Again:
                    return True
                parsed = split_live_frames(frames)
                if parsed is None or not self._in_order(sub, parsed[1]):
                    sub.pending = frames
                    return False
                started = time.perf_counter()
                try:
                    self._apply_live(sub, parsed[1], parsed[2])
                except Exception:  # never let one message kill the subscriber
                    log.exception("kv events from %s: unexpected failure handling a message", sub.label)
                    self.idx.count_garbage_frames(sub.worker_id)
                now = time.perf_counter()
                if self.pace is not None and (pause := self.pace(sub.worker_id, now - started)):
                    sub.pause = pause
                    return False
                if not rx.get(_EVENTS) & _POLLIN:
                    # nothing queued: the monitor is not read here, so one that heard the peer go since `_wake`'s
                    # check still has its descriptor readable, and `_wake` runs again for it (one option read per
                    # batch less, in the common case of one batch per wake-up)
                    return True
                if mon.get(_EVENTS) & _POLLIN:
                    return False  # the next message may be a new peer's: the task handles it
                if now - turn > self.turn_budget_s:
                    return False  # more is queued: the task drains it, yielding between turns
        except zmq.ZMQError:
            return False

    @staticmethod
    def _in_order(sub: Subscription, seq: int) -> bool:
        """Whether live batch ``seq`` is the plain case `_on_message` applies straight away (no restart, gap,
        duplicate, warm-up recheck or rebuild to handle first)."""
        if sub.recheck and sub.applied is None:
            return False
        if sub.last_live is not None and seq <= sub.last_live:
            return False
        return sub.applied is None or seq == sub.applied + 1

    @staticmethod
    def _count_message(sub: Subscription) -> None:
        """A live message arrived: the stream is fresh again, whatever the message turns out to be."""
        st = sub.stats
        st.last_message_monotonic = time.monotonic()
        st.messages += 1
        st.stale = False
        st.silent = False

    def _apply_live(self, sub: Subscription, seq: int, payload: bytes) -> None:
        """`_on_message` for a batch `_in_order` accepted."""
        self._count_message(sub)
        sub.last_live = seq
        self._apply(sub, seq, payload)

    async def _reconnect(self, sub: Subscription) -> None:
        """The SUB's peer went away (a restarted engine, or libzmq dropped it for exceeding ZMQ_MAXMSGSIZE,
        after which it does not reconnect by itself): recreate the socket rather than reconnect it.  A SUB
        keeps the first frame of a queued message it prefetched (libzmq's xsub checks the topic ahead), and a
        reconnected socket glues the next peer's first message to it: the restarted engine's first batch
        would be garbage and the restart unseen.  What the old socket still held is lost with it, so with a
        replay endpoint the history is verified next (`Replayer.verify`)."""
        sub.stats.reconnects += 1
        self._close_socket(sub)
        self._open_socket(sub)
        sub.reconnected = True
        sub.verify = sub.source.replay_endpoint is not None and sub.applied is not None
        await asyncio.sleep(0.05)  # a peer that keeps being dropped is not reconnected in a tight loop

    def resync(self, worker_id: str) -> None:
        """The worker's cache is known to be gone (its process died): drop its entries now, invalidate any
        replay in flight, and warm up again (replay from 0) with its next message."""
        self.idx.clear_worker(worker_id)
        for sub in self._subs.get(worker_id, []):
            self._reset(sub)

    def _reset(self, sub: Subscription) -> None:
        sub.gen += 1
        sub.last_live = None
        sub.applied = None
        sub.digest = 0
        sub.need_warm = sub.source.replay_endpoint is not None
        sub.rewarm_at = None
        sub.rewarm.succeeded()

    def _clear(self, sub: Subscription) -> None:
        """This stream lost state: clear what it fed (its rank, or the whole worker for a rank-less endpoint).
        A storage stream clears nothing: the store's files outlive its publisher and a gap only means some
        chunks went unannounced (less credit); missed removals are bounded by the store's cap."""
        if not sub.source.storage:
            self.idx.clear_worker(sub.worker_id, sub.source.rank)

    def workers(self) -> list[str]:
        """Workers with open subscriptions."""
        return list(self._subs)

    async def detach(self, worker_id: str) -> dict[int | None, int]:
        """Close a worker's subscriptions and leave its entries (and the worker) in the index, for a caller that
        feeds the index another way from here (the KV plane after a fallback). Returns, per rank, the seq of
        the last batch applied, read after the sockets closed (nothing more can come): where the entries end
        in the publisher's numbering. Ranks with none applied are left out."""
        self._refused.pop(worker_id, None)
        subs = self._subs.pop(worker_id, [])
        for sub in subs:
            await self._stop(sub)
        return {sub.source.rank: sub.applied for sub in subs if sub.applied is not None}

    def refused(self) -> dict[str, str]:
        """Workers whose subscription was refused for want of a socket, and why (readiness, /debug/kv)."""
        return {w: why for w, (why, _) in self._refused.items()}

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
            d["unsubscribed"] = 0
            out[wid] = d
        for wid, (why, _) in self._refused.items():
            out[wid] = {**{k: 0 for k in _SUMMED}, "last_seq": None, "heartbeating": False, "stale": False,
                        "silent": False, "kv_endpoints": [], "unsubscribed": 1, "subscribe_error": why}
        return out

    def stats_totals(self, more_than: int) -> dict[str, Any] | None:
        """The counters of :meth:`stats_snapshot` summed over every worker (flags: how many workers have them),
        or None when ``more_than`` workers or fewer are known: a large pool's metrics without a dict per
        worker."""
        if len(self._subs) + len(self._refused) <= more_than:
            return None
        sums = dict.fromkeys(_SUMMED, 0)
        flags = dict.fromkeys(("heartbeating", "stale", "silent"), 0)
        for subs in self._subs.values():
            for s in subs:
                st = s.stats
                for k in _SUMMED:
                    sums[k] += getattr(st, k)
            for k in flags:
                flags[k] += any(getattr(s.stats, k) for s in subs)
        return {**sums, **flags, "unsubscribed": len(self._refused)}

    # -------------------------------------------------------------- staleness
    def check_stale(self, now: float | None = None) -> list[str]:
        """Mark heartbeating workers silent for longer than ``heartbeat_stale_s`` as stale; returns them.  Also
        flags (and logs once) subscriptions that never received anything from a worker that is up."""
        now = time.monotonic() if now is None else now
        stale = []
        poll = self.between_batches
        for k, (wid, subs) in enumerate(self._subs.items()):
            if poll is not None and k % CHECK_POLL_EVERY == CHECK_POLL_EVERY - 1:
                poll()  # an ingest shard's waiting lookups: a thousand workers' check took ~1 ms of its loop
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

    def _check_silent(self, sub: Subscription, now: float) -> None:
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
        next_retry = 0.0
        while True:
            await asyncio.sleep(period)
            self.check_stale()
            now = time.monotonic()
            if self._refused and now >= next_retry:
                next_retry = now + REFUSED_RETRY_S
                for wid, (_, sources) in list(self._refused.items()):
                    if not self._subscribe(wid, sources):
                        break  # still no socket: the others would be refused too

    # -------------------------------------------------------------- the loop
    async def _run(self, sub: Subscription) -> None:
        turn = time.perf_counter()
        while True:
            try:
                if sub.need_warm:
                    await self._replayer.warm_up(sub)
                elif sub.verify:
                    sub.verify = False
                    await self._replayer.verify(sub)
                    continue
                elif sub.rewarm_at is not None and time.monotonic() >= sub.rewarm_at:
                    # on its own schedule: an idle engine (vLLM sends no heartbeats) sends nothing to wait for
                    log.info("kv events from %s: rebuilding from the replay buffer after a failed replay", sub.label)
                    bound = sub.last_live
                    await self._replayer.warm_up(sub, recheck=False, keep=True)
                    if self._rebuilt(sub) and bound is not None and (sub.applied is None or sub.applied < bound):
                        # the same process's buffer holds every batch it sent: one that ends below the last
                        # live seq is another process's numbering, found here and not again at its next batch
                        self._count_restart(sub, f"the replay buffer ends at {sub.applied}, below the last "
                                                 f"live seq {bound}")
                        sub.last_live = None
                    continue
                frames, sub.pending = sub.pending, None
                if frames is None:
                    frames = await self._receive(sub)
                if frames is not None:
                    started = time.perf_counter()
                    await self._on_message(sub, frames)
                    if self.pace is not None and (pause := self.pace(sub.worker_id, time.perf_counter() - started)):
                        await asyncio.sleep(pause)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if sub.sock is None or sub.sock.closed:
                    return
                log.warning("kv events recv from %s failed: %s", sub.label, exc)
                await asyncio.sleep(0.1)
            except Reset:
                continue
            except Exception:  # never let one message kill the subscriber
                log.exception("kv events from %s: unexpected failure handling a message", sub.label)
                self.idx.count_garbage_frames(sub.worker_id)
            # a queued message is returned without yielding: bound the work done per loop turn
            now = time.perf_counter()
            if now - turn > self.turn_budget_s:
                await asyncio.sleep(0)
                turn = time.perf_counter()

    async def _receive(self, sub: Subscription) -> list[bytes] | None:
        """The next live message, or None when the loop has something else to do first: the SUB's peer went
        away (the socket is recreated here), or the rewarm timer is due.  A queued message is read without
        waiting; waiting is on the sockets' descriptors, so waking for the timer never loses a message."""
        rx, mon = sub.rx, sub.mon_rx
        if rx is None or mon is None:  # closed under the task (`_stop` after its cancel went unheard)
            raise zmq.ZMQError(zmq.ENOTSOCK)
        if mon.get(_EVENTS) & _POLLIN:
            await self._drain_monitor_and_reconnect(sub)
            return None
        if rx.get(_EVENTS) & _POLLIN:
            with contextlib.suppress(zmq.Again):
                return _recv_frames(rx)
        timeout = None if sub.rewarm_at is None else max(0.001, sub.rewarm_at - time.monotonic() + 0.001)
        await self._wait(sub, timeout)
        if sub.pause:  # a batch `_wake` applied put the worker over its budget
            pause, sub.pause = sub.pause, 0.0
            await asyncio.sleep(pause)
        return None

    async def _wait(self, sub: Subscription, timeout: float | None) -> None:
        """Until `_wake` sees either socket's descriptor readable (or `timeout` seconds). The caller has just
        read both sockets' ``EVENTS`` (which consumes libzmq's pending signal), so anything that arrives
        after that signals the descriptor again: no message is missed between the check and the wait."""
        assert sub.loop is not None
        w = sub.waiter = sub.loop.create_future()
        timer = None if timeout is None else sub.loop.call_later(timeout, _done, w)
        try:
            await w
        finally:
            if timer is not None:
                timer.cancel()
            if sub.waiter is w:
                sub.waiter = None

    async def _drain_monitor_and_reconnect(self, sub: Subscription) -> None:
        assert sub.mon_rx is not None
        with contextlib.suppress(zmq.Again):
            while True:
                sub.mon_rx.recv_multipart(_NOBLOCK)
        await self._reconnect(sub)

    def _peek(self, sub: Subscription) -> int | None:
        """The seq of the next live message, read from the SUB without waiting and kept in ``sub.pending``
        for the receive loop: where a replay in progress may stop (the live stream goes on from there)."""
        if sub.pending is None and sub.rx is not None and not sub.rx.closed:
            try:
                sub.pending = _recv_frames(sub.rx)
            except zmq.ZMQError:
                return None
        parsed = split_live_frames(sub.pending) if sub.pending is not None else None
        return None if parsed is None else parsed[1]

    def _apply(self, sub: Subscription, seq: int, payload: bytes) -> None:
        if sub.source.storage:
            batch = decode_storage_payload(payload, self.max_batch_events)
            if batch.reason == TOO_MANY_EVENTS:
                sub.stats.oversized += 1
            self.idx.apply_storage_batch(sub.worker_id, batch)  # counts a garbage or oversized batch
        else:
            self._apply_events(sub, seq, payload)
        sub.applied = seq
        sub.digest = xxhash.xxh3_64_intdigest(payload)
        sub.stats.last_seq = seq
        if self.between_batches is not None:
            self.between_batches()

    def _apply_events(self, sub: Subscription, seq: int, payload: bytes) -> None:
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

    def _warn_gap(self, sub: Subscription, first: int, last: int) -> None:
        now = time.monotonic()
        if now - sub.gap_warned_at >= GAP_WARN_INTERVAL_S:
            more = f" (+{sub.gaps_unwarned} more gaps since the last warning)" if sub.gaps_unwarned else ""
            log.warning("kv events from %s: gap %d..%d%s", sub.label, first, last, more)
            sub.gap_warned_at = now
            sub.gaps_unwarned = 0
        else:
            sub.gaps_unwarned += 1

    async def _on_message(self, sub: Subscription, frames: list[bytes]) -> None:
        self._count_message(sub)
        st = sub.stats
        reconnected, sub.reconnected = sub.reconnected, False
        parsed = split_live_frames(frames)
        if parsed is None:
            self.idx.count_garbage_frames(sub.worker_id)
            if reconnected:
                # a restarted engine's first batch glued to a frame the old peer left behind looks like this:
                # what the rank holds may be a dead process's, so rebuild it rather than keep it
                self._restart(sub, "the first message after a reconnect is malformed", None)
            return
        _, seq, payload = parsed
        last_live = sub.last_live
        sub.last_live = seq
        rebuilt = False  # the rank was rebuilt from this publisher's buffer up to this message, just now
        if sub.recheck and sub.applied is None:
            # Nothing was applied yet, so nothing tells whether batches came before this one: those published
            # between the warm-up's answer and the moment the PUB registered this SUB went to nobody.
            await self._replayer.warm_up(sub, recheck=False, live=seq)  # raises Reset if reset meanwhile
            rebuilt = self._rebuilt(sub)
        elif sub.rewarm_at is not None and st.last_message_monotonic >= sub.rewarm_at:
            log.info("kv events from %s: rebuilding from the replay buffer after a failed replay", sub.label)
            await self._replayer.warm_up(sub, recheck=False, keep=True, live=seq)
            rebuilt = self._rebuilt(sub)
        applied = sub.applied
        if last_live is not None and seq <= last_live and rebuilt:
            # a restart, but what the rank holds is already the new process's buffer: count it, keep the rank
            self._count_restart(sub, f"seq went back to {seq}")
            if applied is not None and seq <= applied:
                return
        elif last_live is not None and seq <= last_live:
            self._restart(sub, f"seq went back to {seq}", seq)
        elif applied is not None and seq <= applied:
            return  # already applied through replay
        elif applied is not None and seq > applied + 1:
            st.gaps += 1
            st.dropped_batches += seq - applied - 1
            self._warn_gap(sub, applied + 1, seq - 1)
            if seq - applied > FAR_JUMP:
                self._restart(sub, f"seq jumped from {applied} to {seq}", seq)
            elif sub.source.replay_endpoint and sub.rewarm_at is None:
                # (while a rebuild is pending the endpoint just failed: clear, and let the rebuild bring it back)
                await self._replayer.recover(sub, applied, live=seq)  # raises Reset if reset meanwhile
                if sub.applied is not None and seq <= sub.applied:
                    return
                if sub.applied is not None and seq > sub.applied + 1:
                    self._clear(sub)  # the replay did not reach this batch: its predecessors are lost
            else:
                self._clear(sub)
        if sub.need_warm:
            await self._replayer.warm_up(sub, live=seq)
            if sub.applied is not None and seq <= sub.applied:
                return
        self._apply(sub, seq, payload)

    def _restart(self, sub: Subscription, why: str, live: int | None) -> None:
        """The publisher restarted: count it, clear what the stream fed, and warm up from its new buffer.

        ``live``: the seq of the live message that showed the restart, the new process's numbering and so the
        bound the next restart check compares with; None when it was found otherwise (a replay, a malformed
        first message). The dead process's last seq is never kept as the bound: the new process's next
        batches number below it, and each would be taken for another restart, counted again and clear the
        blocks the warm-up had just restored (issue 43 item 4)."""
        self._count_restart(sub, why)
        self._clear(sub)
        self._reset(sub)
        sub.last_live = live

    @staticmethod
    def _count_restart(sub: Subscription, why: str) -> None:
        log.warning("kv events from %s: %s, publisher restarted", sub.label, why)
        sub.stats.restarts += 1

    @staticmethod
    def _rebuilt(sub: Subscription) -> bool:
        """Whether the warm-up that just ran completed (no rebuild scheduled after a failure, no reset asked):
        the rank is then exactly the publisher's buffer, whichever process numbered it."""
        return sub.rewarm_at is None and not sub.need_warm
