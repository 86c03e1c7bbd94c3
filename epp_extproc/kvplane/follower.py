"""The picker's side of ``--kv-event-plane nats``: one NATS subscription per pool feeding the same KvIndex.

It stands where :class:`~kvindex.subscriber.SubscriberManager` stands in
:class:`~epp_extproc.adapters.kv_routing.KvRouting` (``add``/``remove``/``resync``/``stats_snapshot``/``close``)
so the routing code does not know which plane feeds its index; batches are decoded and applied by the same
decoder and ``KvIndex.apply_batch`` as on the ZeroMQ plane.

Per worker, the plane's stream follows today's rules, with the relay's dump in the role of the engine's
replay:

* **start / join**: the picker asks the worker's relay for a dump and buffers (bounded) the live messages that
  arrive meanwhile; it loads the dump (the worker's entries replaced), then applies the buffered messages
  after the dump's sequence, and follows the live stream from there;
* **gap**: a sequence jump on the plane (a message NATS or the relay dropped), or a relay heartbeat that says
  the stream went further than what arrived (the tail was lost), is answered with a new dump;
* **restart**: another epoch on a worker's messages is another relay process (it rebuilt its index). When
  the new relay's stream reaches the picker from its first message (the relay queues what it reads before its
  first connect) and continues the engine's numbering (each rank's first batch comes after the last one the
  picker applied), the picker **carries** what it holds and follows the new stream without a dump: the new
  relay knows only what it read since it started (the engine keeps no replay unless configured), and
  replacing the picker's entries with that partial index cost the trace benchmark 10% of its cached tokens
  after a relay restart (``cnr``). The engine batches nobody relayed meanwhile are lost either way and
  counted (``carried_missed``); a stale entry they leave is an eviction the picker did not see, as after a
  ZeroMQ gap, until the engine stores or drops that block again. A rank whose numbering went back (the engine
  restarted too) or that the picker has no position for is cleared at its first message. A new stream
  whose first message did not arrive gets a dump; the dump says per rank where the relay's history begins
  (its first batch since it started, or since it last cleared the rank), and a dump of another relay than
  the one the entries followed is loaded **on top** of them when that history begins after where they end
  (the same rule as the carry's first batch; `_merges`), else in their place. A clear message is the relay's
  own gap or engine restart, applied as the clear it was there;
* **two relays for one worker** (a pool relay's rolling update, or a mistake): the worker follows one; the
  new relay's first message hands over to it, and the other's messages are ignored while the followed one is
  heard (`_other`), unless it delivers none of the other's batches for ``relay_stale_s`` (`_overtaken`). A
  stopping relay says goodbye, so what follows it is a restart at once;
* **faults**: NATS down (the client noticed, pings every second), or no heartbeat from a worker's relay for
  ``relay_stale_s``: the worker falls back to today's direct ZeroMQ subscription (or, with ``--kv-plane-fallback
  load``, its entries are dropped and it routes by load), counted; when the plane is back, a dump brings the
  worker back onto it, the direct subscription is closed, counted as a recovery. No request waits for any of
  this: lookups read the index as it is.

Malformed messages and dumps are refused like malformed ZeroMQ frames: counted (per worker where the subject
names a known worker, ``garbage_frames``), never applied, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from epp_extproc.kvplane.link import NatsLink
from epp_extproc.kvplane.wire import (
    HEARTBEAT_TOKEN,
    KIND_BATCH,
    MAX_DUMP_CHUNKS,
    DumpChunk,
    LiveMessage,
    Malformed,
    Subjects,
    encode_dump_request,
    parse_dump_chunk,
    parse_heartbeat,
    parse_live,
    worker_token,
)
from kvindex.aio import cancel_and_wait
from kvindex.backoff import Backoff
from kvindex.decode import TOO_MANY_EVENTS, decode_payload
from kvindex.dump import load_slots
from kvindex.index import KvIndex
from kvindex.subscriber import FAR_JUMP, KvSource, SubscriberManager

if TYPE_CHECKING:
    from epp_extproc.tracing.spans import Tracing

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.5


@dataclass(slots=True)
class PlaneStats:
    """One worker's plane counters (``/debug/kv`` under ``kv_plane``, and the ``epp_kv_plane_*`` metrics)."""

    mode: str = "wait"  # wait (no relay yet) | dumping | rejoining (see `_rejoin`) | live
    fallback: bool = False  # fed by the direct ZeroMQ subscription (or load-only) meanwhile
    epoch: int | None = None
    seq: int | None = None
    messages: int = 0
    gaps: int = 0
    dropped_batches: int = 0
    relay_restarts: int = 0
    dumps: int = 0
    dump_failures: int = 0
    dumps_refused: int = 0
    dump_blocks: int = 0
    buffer_overflows: int = 0
    oversized: int = 0
    garbage: int = 0
    fallbacks: int = 0
    recoveries: int = 0
    carried: int = 0  # relay restarts followed without a dump, the worker's entries kept (see the module doc)
    carried_missed: int = 0  # engine batches no relay published across those restarts
    carry_cleared: int = 0  # ranks cleared at a carried restart: their numbering went back, or was unknown
    dumps_merged: int = 0  # a new relay's dumps loaded on top of the worker's entries (see `_merges`)
    other_relay: int = 0  # messages, heartbeats and dump chunks of a second relay for the worker, ignored


@dataclass(slots=True)
class _Stream:
    worker_id: str
    sources: list[KvSource]
    stats: PlaneStats = field(default_factory=PlaneStats)
    buffer: deque[LiveMessage] = field(default_factory=deque)
    last_heard: float = 0.0
    dump_task: asyncio.Task[None] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    backoff: Backoff = field(default_factory=lambda: Backoff(0.2, 5.0))
    # per rank (None: one rank), the engine seq of the last batch the worker's entries contain, as far as the
    # plane told it (live batches, a dump's `engine_seqs`): what a carried restart is checked against
    engine_seq: dict[int | None, int] = field(default_factory=dict)
    # after a carried restart: the ranks whose first message in the new epoch was checked (None: no carry)
    carry_checked: set[int | None] | None = None
    # in that carry, a batch up to the entries' position was applied already, not another engine's numbering:
    # the direct subscription followed the engine (`PlaneSubscribers._rejoin`), or the relay followed until
    # now is still heard (a handover between two relays, `_carry`): such batches are skipped, not checked
    overlapped: bool = False
    # the relay followed (`stats.epoch`): when it was last heard, and whether it said goodbye. While it is
    # heard, another relay's messages for the worker are a second relay publishing it, not a restart
    followed_heard: float = 0.0
    followed_gone: bool = False
    warned_epochs: set[int] = field(default_factory=set)  # second relays already logged (bounded, see `_other`)
    other_ahead_since: float | None = None  # a second relay's batches ahead of the entries since (`_overtaken`)


class PlaneSubscribers:
    """KvRouting's subscriber on the NATS plane, with ``fallback`` (today's ZeroMQ subscriber on the same
    index) for the workers the plane cannot serve right now."""

    def __init__(self, idx: KvIndex, fallback: SubscriberManager, servers: Sequence[str], subjects: Subjects, *,
                 fallback_mode: str = "zmq", name: str = "epp-picker", max_batch_bytes: int = 16 * 1024 * 1024,
                 max_batch_events: int = 16_384, dump_timeout_s: float = 3.0, relay_stale_s: float = 5.0,
                 max_buffered: int = 10_000, max_dump_bytes: int | None = None,
                 dump_concurrency: int = 8, first_connect_grace_s: float = 2.0,
                 registry: CollectorRegistry | None = None, direct_dispatch: bool = True) -> None:
        """``relay_stale_s``: a worker whose relay said nothing (no batch, no heartbeat) this long falls back;
        ``first_connect_grace_s``: how long a starting picker waits for its first NATS connect before its
        workers fall back; ``max_buffered``: live messages kept per worker while its dump is in flight;
        ``max_dump_bytes``: a dump's budget (None: twice the index's per-worker cap in pairs, 16 bytes each);
        ``direct_dispatch``: the pool's messages handled from the client's read loop (`NatsLink.subscribe_direct`)
        rather than through nats-py's subscription queue and task (False: only for ``bench_kvplane``'s A/B)."""
        if fallback_mode not in ("zmq", "load"):
            raise ValueError(f"fallback mode {fallback_mode!r}: zmq or load")
        self.idx = idx
        self.fallback = fallback
        self.subjects = subjects
        self.fallback_mode = fallback_mode
        self.max_batch_bytes = max_batch_bytes
        self.max_batch_events = max_batch_events
        self.dump_timeout_s = dump_timeout_s
        self.relay_stale_s = relay_stale_s
        self.max_buffered = max_buffered
        self.max_dump_bytes = max_dump_bytes
        self.first_connect_grace_s = first_connect_grace_s
        self.direct_dispatch = direct_dispatch
        self.link = NatsLink(servers, name, on_up=self._on_up, on_down=self._on_down)
        self._streams: dict[str, _Stream] = {}
        self._by_token: dict[str, str] = {}
        self._dump_slots = asyncio.Semaphore(dump_concurrency)
        self._sub: Any = None
        self._watchdog: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.garbage = 0  # malformed messages on the subjects, over all workers (also per worker when known)
        self.unknown_workers = 0  # messages about workers this picker does not route to
        self.heartbeats = 0
        # set by the app when tracing is on: each dump asked and loaded (or not) is a root span (no request
        # waits for one: lookups read the index as it is)
        self.tracing: Tracing | None = None
        if registry is not None:
            registry.register(_PlaneCollector(self))

    # ------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        if self._watchdog is None:
            self.link.start()
            self._watchdog = asyncio.create_task(self._watch(), name="kv-plane-watchdog")

    async def add(self, worker_id: str, endpoint: str | Sequence[KvSource], replay_endpoint: str | None = None) -> None:
        """Follow a worker on the plane (`SubscriberManager.add`'s signature); its ZeroMQ sources are kept for
        the fallback, never opened while the plane serves it."""
        if self._closed:
            raise RuntimeError("PlaneSubscribers is closed")
        sources = [KvSource(endpoint, replay_endpoint)] if isinstance(endpoint, str) else list(endpoint)
        if worker_id in self._streams:
            await self.remove(worker_id)
        self.idx.add_worker(worker_id)
        ranked = [s.rank for s in sources if s.rank is not None]
        if ranked:
            self.idx.set_ranks(worker_id, max(ranked) + 1)
        st = _Stream(worker_id, sources, last_heard=time.monotonic())
        self._streams[worker_id] = st
        self._by_token[worker_token(worker_id)] = worker_id
        self._start()
        if self.link.connected:
            self._dump(st)
        elif self.link.connects:  # the plane was up and is down now: the direct events at once
            self._fall_back(st, "NATS is not connected")
        # else the first connect is under way: the watchdog falls back after `first_connect_grace_s`, so a
        # picker starting beside a healthy NATS does not open (and close again) one socket per worker

    async def remove(self, worker_id: str) -> None:
        """Stop following a worker (its dump, its fallback sockets) and drop it from the index."""
        st = self._streams.pop(worker_id, None)
        self._by_token.pop(worker_token(worker_id), None)
        if st is not None:
            await cancel_and_wait([st.dump_task])
            async with st.lock:
                if st.stats.fallback:
                    await self.fallback.detach(worker_id)
        self.idx.drop_worker(worker_id)

    async def close(self) -> None:
        """Stop everything, the fallback subscriber included (the index keeps its entries)."""
        self._closed = True
        streams, self._streams = list(self._streams.values()), {}
        await cancel_and_wait([self._watchdog, *self._tasks, *(s.dump_task for s in streams)])
        await self.link.close()
        await self.fallback.close()

    def resync(self, worker_id: str) -> None:
        """The worker's process died: its entries go now; the relay clears its own (and says so on the plane)
        once the restarted engine's stream shows the restart. Fallback subscriptions resync as today."""
        self.idx.clear_worker(worker_id)
        st = self._streams.get(worker_id)
        if st is not None:
            st.engine_seq.clear()
            if st.stats.fallback:
                self.fallback.resync(worker_id)

    def workers(self) -> list[str]:
        return list(self._streams)

    def refused(self) -> dict[str, str]:
        return self.fallback.refused()

    def stats(self, worker_id: str) -> PlaneStats:
        return self._streams[worker_id].stats

    def stats_snapshot(self) -> dict[str, dict[str, Any]]:
        """The fallback's per-worker counters (workers on ZeroMQ now), each worker's plane counters under
        ``kv_plane`` (`/debug/kv`)."""
        out = self.fallback.stats_snapshot()
        for wid, st in self._streams.items():
            out.setdefault(wid, {})["kv_plane"] = asdict(st.stats)
        return out

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ the link
    async def _on_up(self) -> None:
        nc = self.link.nc
        if nc is None or self._closed:
            return
        if self._sub is None:
            # one subscription for the whole pool: every worker's batches and the relays' heartbeats, in the
            # order each relay sent them (a heartbeat never overtakes the batches before it). Each message is
            # handled as the client parses it (`NatsLink.subscribe_direct`: no queue and task hop per message),
            # so a picker that cannot keep up backs up its socket until the server's slow-consumer limit cuts
            # the link: the fallback, then a dump per worker. The pending limits bound nats-py's queue (the
            # messages parsed before the handler was registered; all of them without `direct_dispatch`).
            limits = {"pending_msgs_limit": 100_000, "pending_bytes_limit": 64 * 1024 * 1024}
            if self.direct_dispatch:
                self._sub = await self.link.subscribe_direct(self.subjects.events_all, self._on_message, **limits)
            else:
                async def queued(msg: Any) -> None:
                    self._on_message(msg.subject, msg.data)

                self._sub = await nc.subscribe(self.subjects.events_all, cb=queued, **limits)
        now = time.monotonic()
        for st in self._streams.values():
            st.last_heard = now
            self._dump(st)  # whatever was missed while it was down: the dump has it

    def _on_down(self) -> None:
        if self._streams:
            log.warning("kv plane: NATS link lost: %d workers fall back to %s until it is back", len(self._streams),
                        "their direct ZeroMQ events" if self.fallback_mode == "zmq" else "load-only routing")
        for st in self._streams.values():
            self._fall_back(st, "NATS link lost", quiet=True)

    # ---------------------------------------------------------- live stream
    def _on_message(self, subject: str, data: bytes) -> None:
        token = subject.rpartition(".")[2]
        if token == HEARTBEAT_TOKEN:
            self._on_heartbeat(data)
            return
        m = parse_live(data, self.max_batch_bytes)
        known = self._by_token.get(token)
        # the id in the message must be the one its subject names; for a worker this picker follows the token
        # was computed once, at `add` (no regex and hash per message on the hot path); anything else is checked
        if m is None or (m.worker_id != known and worker_token(m.worker_id) != token):
            self._refuse_message(known)
            return
        st = self._streams.get(m.worker_id)
        if st is None:
            self.unknown_workers += 1
            return
        self._on_live(st, m)

    def _refuse_message(self, worker_id: str | None) -> None:
        self.garbage += 1
        st = self._streams.get(worker_id) if worker_id is not None else None
        if st is not None:
            st.stats.garbage += 1
            self.idx.count_garbage_frames(st.worker_id)

    def _on_live(self, st: _Stream, m: LiveMessage) -> None:
        s = st.stats
        s.messages += 1
        st.last_heard = time.monotonic()
        if s.mode != "live":
            if len(st.buffer) >= self.max_buffered:
                st.buffer.popleft()  # the next dump or the gap after it brings this back
                s.buffer_overflows += 1
            st.buffer.append(m)
            if s.mode in ("wait", "dumping") and self.link.connected:
                if m.seq == 1 and m.epoch != s.epoch and self._can_rejoin(st):
                    self._start_rejoin(st, m.epoch)
                elif s.mode == "wait":
                    self._dump(st)
            return
        if m.epoch != s.epoch:
            if m.seq == 1 and self._carry(st, m.epoch):
                s.relay_restarts += 1
            elif self._overtaken(st, m) and self._carry(st, m.epoch):
                s.seq = m.seq - 1  # followed from this message on; what it published before is missed, counted
                s.relay_restarts += 1
            elif self._other(st, m.epoch):
                return
            else:
                s.relay_restarts += 1
                log.warning("kv plane: %s comes from another relay process now (epoch %d -> %d): asking its "
                            "dump", st.worker_id, s.epoch, m.epoch)
                st.buffer.append(m)
                self._dump(st)
                return
        else:
            st.followed_heard = st.last_heard
        assert s.seq is not None
        if m.seq <= s.seq:
            return  # already in the dump
        if m.seq > s.seq + 1:
            s.gaps += 1
            s.dropped_batches += m.seq - s.seq - 1
            st.buffer.append(m)
            self._dump(st)
            return
        self._apply(st, m)

    def _apply(self, st: _Stream, m: LiveMessage) -> None:
        st.stats.seq = m.seq
        if st.carry_checked is not None and m.rank not in st.carry_checked and not self._check_carry(st, m):
            return
        if m.kind != KIND_BATCH:
            self._clear_rank(st, m.rank)
            return
        batch = decode_payload(m.payload, self.max_batch_events)
        if batch.reason == TOO_MANY_EVENTS:
            st.stats.oversized += 1
            self._clear_rank(st, m.rank)
            return
        self.idx.apply_batch(st.worker_id, batch, m.rank)
        st.engine_seq[m.rank] = m.engine_seq
        st.other_ahead_since = None  # the relay followed delivers

    def _clear_rank(self, st: _Stream, rank: int | None) -> None:
        self.idx.clear_worker(st.worker_id, rank)
        if rank is None:
            st.engine_seq.clear()
        else:
            st.engine_seq.pop(rank, None)

    # ------------------------------------------------------- carried restarts
    def _carry(self, st: _Stream, epoch: int) -> bool:
        """A new relay's stream from its start: follow it on what the worker's entries hold (see the module
        doc), or False (nothing to carry: the picker knows no engine position) and the caller asks a dump."""
        if not st.engine_seq:
            return False
        s = st.stats
        log.warning("kv plane: %s comes from another relay process now (epoch %s -> %s): following its stream "
                    "from its start, the worker's entries kept", st.worker_id, s.epoch, epoch)
        handover = self._followed_alive(st)
        s.epoch, s.seq = epoch, 0
        s.carried += 1
        st.carry_checked, st.overlapped = set(), handover
        self._follow(st)
        return True

    @staticmethod
    def _follow(st: _Stream) -> None:
        """The worker now follows the relay of ``st.stats.epoch``, heard just now."""
        st.followed_heard, st.followed_gone, st.other_ahead_since = time.monotonic(), False, None
        st.warned_epochs.clear()

    def _overtaken(self, st: _Stream, m: LiveMessage) -> bool:
        """A second relay's batch while the one followed is heard: has that one delivered nothing for
        ``relay_stale_s`` while this one kept publishing batches past the entries' position? (Its process is
        alive, its heartbeats say so, but its subscription to the worker is not.) Then the worker follows this
        relay from this message: the batches it published before are missed, counted as after a restart."""
        if m.kind != KIND_BATCH or m.engine_seq <= st.engine_seq.get(m.rank, -1) or not self._followed_alive(st):
            return False
        now = time.monotonic()
        if st.other_ahead_since is None:
            st.other_ahead_since = now
            return False
        if now - st.other_ahead_since <= self.relay_stale_s:
            return False
        log.warning("kv plane: %s: the relay followed (epoch %s) has delivered none of the batches a second relay "
                    "(epoch %d) published for %.1fs: following that one", st.worker_id, st.stats.epoch, m.epoch,
                    now - st.other_ahead_since)
        st.followed_gone = True  # (the carry that follows is no handover: nothing was applied through it)
        return True

    def _followed_alive(self, st: _Stream) -> bool:
        return not st.followed_gone and time.monotonic() - st.followed_heard <= self.relay_stale_s

    def _other(self, st: _Stream, epoch: int) -> bool:
        """Is ``epoch`` a second relay publishing the worker while the one followed is alive (a pool relay's
        rolling update, or two relays configured for one worker)? Then its messages are ignored, counted, and
        logged once: following both would be a relay restart at every message, each answered by a dump. A
        restart is told apart by the new relay's first message (carried) or the old one's silence (its goodbye,
        or ``relay_stale_s``), after which the other stream is taken as the restart it is."""
        if not self._followed_alive(st):
            return False
        st.stats.other_relay += 1
        if epoch not in st.warned_epochs and len(st.warned_epochs) < 16:
            st.warned_epochs.add(epoch)
            log.warning("kv plane: a second relay (epoch %d) publishes %s beside the one followed (epoch %s): "
                        "ignored while that one is heard (a relay's rolling update hands over at the new relay's "
                        "first message; two relays configured for one worker only add load)", epoch, st.worker_id,
                        st.stats.epoch)
        return True

    def _check_carry(self, st: _Stream, m: LiveMessage) -> bool:
        """The first message of a rank after a carried restart: does it continue the engine's numbering?
        False: skip it (``overlapped``: a batch the picker had applied already)."""
        assert st.carry_checked is not None
        last = st.engine_seq.get(m.rank)
        if st.overlapped and m.kind == KIND_BATCH and last is not None and m.engine_seq <= last:
            return False  # (applied through the direct subscription, or the relay followed until the handover)
        st.carry_checked.add(m.rank)
        if m.rank is None:
            st.carry_checked = None  # (a worker of one rank, or a clear of all: nothing left to check)
        if m.kind != KIND_BATCH:
            return True  # the new relay cleared the rank itself: nothing is kept to check
        if last is not None and last < m.engine_seq and m.engine_seq - last <= FAR_JUMP:
            st.stats.carried_missed += m.engine_seq - last - 1
            return True
        st.stats.carry_cleared += 1
        log.warning("kv plane: %s rank %s: the new relay's stream starts at engine seq %d, the picker's entries "
                    "end at %s: another engine process, or no position; cleared", st.worker_id, m.rank,
                    m.engine_seq, last)
        self._clear_rank(st, m.rank)
        return True

    def _can_rejoin(self, st: _Stream) -> bool:
        return st.stats.fallback and self.fallback_mode == "zmq" and st.worker_id in self.fallback.workers()

    def _start_rejoin(self, st: _Stream, epoch: int) -> None:
        st.stats.mode = "rejoining"
        self._spawn(self._rejoin(st, epoch))

    async def _rejoin(self, st: _Stream, epoch: int) -> None:
        """A new relay's stream from its start while the worker's own ZeroMQ events feed it (the relay was
        silent past ``relay_stale_s``, or this picker has not had a relay for it yet): back onto the plane
        without a dump, carrying what the direct subscription built. The new relay knows only what it read
        since it started; the direct subscription followed the engine all along. Its sockets are closed
        first, then each rank's position is read (nothing more can come), and the new stream's batches up to
        that position are skipped, the next ones applied; the relay's messages meanwhile are buffered. A dump
        being retried meanwhile (no relay had answered this picker for the worker yet) is cancelled."""
        s = st.stats
        async with st.lock:
            if (self._streams.get(st.worker_id) is not st or s.mode != "rejoining" or not s.fallback
                    or not self.link.connected):
                if s.mode == "rejoining":
                    s.mode = "wait"
                return
            # a dump still being retried (this picker had no relay for the worker yet) is not needed any more;
            # it is never inside this lock, where it loads, so cancelling it leaves nothing half done
            await cancel_and_wait([st.dump_task])
            positions = await self.fallback.detach(st.worker_id)
            s.fallback = False
            s.recoveries += 1
            st.engine_seq = positions
            s.mode = "live"
            if not self._carry(st, epoch):  # no batch came through the direct subscription: nothing to carry
                s.mode = "dumping"
                self._dump(st)
                return
            st.overlapped = True
            log.info("kv plane: %s back on the plane, its entries carried from its direct events (engine seqs %s)",
                     st.worker_id, positions)
            buffered, st.buffer = st.buffer, deque()
            for m in buffered:
                if s.mode != "live":
                    st.buffer.append(m)
                else:
                    self._on_live(st, m)
                    s.messages -= 1  # counted when it arrived

    def _on_heartbeat(self, data: bytes) -> None:
        hb = parse_heartbeat(data, self.max_batch_bytes)
        if hb is None:
            self._refuse_message(None)
            return
        self.heartbeats += 1
        now = time.monotonic()
        for wid, seq in hb.workers.items():
            st = self._streams.get(wid)
            if st is None:
                continue
            s = st.stats
            if hb.bye:  # its relay stops: what comes next for the worker is a restart, whatever its first message
                st.followed_gone = st.followed_gone or hb.epoch == s.epoch
                continue
            st.last_heard = now
            if hb.epoch == s.epoch:
                st.followed_heard = now
            if s.mode in ("wait", "dumping") and hb.epoch != s.epoch and seq == 0 and self._can_rejoin(st):
                self._start_rejoin(st, hb.epoch)  # a new relay that has sent nothing for it yet
            elif s.mode == "wait":
                self._dump(st)
            elif s.mode == "live" and hb.epoch != s.epoch and seq == 0 and self._carry(st, hb.epoch):
                s.relay_restarts += 1  # a new relay that has sent nothing for this worker yet: its first comes
            elif s.mode == "live" and hb.epoch != s.epoch and self._other(st, hb.epoch):
                continue
            elif s.mode == "live" and (hb.epoch != s.epoch or s.seq is None or seq > s.seq):
                if hb.epoch != s.epoch:
                    s.relay_restarts += 1
                else:
                    s.gaps += 1  # the tail of the stream was lost: nothing else would show it
                    s.dropped_batches += seq - (s.seq or 0)
                self._dump(st)

    # ---------------------------------------------------------------- dumps
    def _dump(self, st: _Stream) -> None:
        """Ask (once at a time) for the worker's dump; live messages are buffered until it is loaded."""
        if st.stats.mode != "dumping" or st.dump_task is None or st.dump_task.done():
            st.stats.mode = "dumping"
            if st.dump_task is None or st.dump_task.done():
                st.dump_task = asyncio.create_task(self._dump_loop(st), name=f"kv-plane-dump-{st.worker_id}")

    async def _dump_loop(self, st: _Stream) -> None:
        s = st.stats
        while self._streams.get(st.worker_id) is st:
            if not self.link.connected:
                s.mode = "wait"
                return
            asked_ns = time.time_ns() if self.tracing is not None else 0
            try:
                async with self._dump_slots:
                    chunks = await self._request_dump(st.worker_id)
            except asyncio.CancelledError:
                raise
            except Malformed as exc:
                s.dumps_refused += 1
                self._refuse_message(st.worker_id)
                log.warning("kv plane: dump of %s refused: %s", st.worker_id, exc)
                if self.tracing is not None:
                    self.tracing.dump_loaded(st.worker_id, asked_ns, subject=self.subjects.dump(st.worker_id),
                                             error=("malformed", str(exc)))
            except Exception as exc:
                s.dump_failures += 1
                log.info("kv plane: no dump of %s (%s): %s", st.worker_id, type(exc).__name__, exc)
                if self.tracing is not None:
                    self.tracing.dump_loaded(st.worker_id, asked_ns, subject=self.subjects.dump(st.worker_id),
                                             error=(type(exc).__name__, str(exc)))
            else:
                async with st.lock:
                    direct = await self.fallback.detach(st.worker_id) if st.stats.fallback else None
                    if self._streams.get(st.worker_id) is not st:
                        return
                    merged = self._load(st, chunks, direct)  # synchronous from here: nothing applied in between
                if self.tracing is not None:
                    self.tracing.dump_loaded(st.worker_id, asked_ns, blocks=s.dump_blocks, chunks=len(chunks),
                                             subject=self.subjects.dump(st.worker_id), merged=merged)
                st.backoff.succeeded()
                if s.mode != "dumping":
                    return
                continue  # the buffered messages after the dump had a gap: the next dump at once
            self._fall_back(st, "no usable dump")
            await asyncio.sleep(st.backoff.failed())

    async def _request_dump(self, worker_id: str) -> list[DumpChunk]:
        nc = self.link.nc
        if nc is None:
            raise ConnectionError("NATS not connected")
        inbox = nc.new_inbox()
        got: asyncio.Queue[bytes] = asyncio.Queue(MAX_DUMP_CHUNKS + 1)
        max_chunk = max(nc.max_payload, 1024)
        budget = self.max_dump_bytes or (self.idx.max_blocks_per_worker * 2 * 16 + max_chunk)
        overflow = False

        async def on_chunk(msg: Any) -> None:
            nonlocal overflow
            if msg.headers and msg.headers.get("Status") == "503":
                got.put_nowait(b"")  # the server says nobody serves the subject: no relay (yet), not garbage
                return
            try:
                got.put_nowait(msg.data)
            except asyncio.QueueFull:
                overflow = True

        sub = await nc.subscribe(inbox, cb=on_chunk)
        try:
            await nc.publish(self.subjects.dump(worker_id), encode_dump_request(worker_id), reply=inbox)
            deadline = time.monotonic() + self.dump_timeout_s
            # per relay (epoch): where two relays serve the worker (see `_other`), both answer; the first whole
            # dump is taken, the other relay's chunks are counted and dropped
            chunks: dict[int, dict[int, DumpChunk]] = {}
            firsts: dict[int, DumpChunk] = {}
            total = ignored = 0
            while True:
                async with asyncio.timeout(max(0.001, deadline - time.monotonic())):  # (not wait_for: test_aio)
                    data = await got.get()
                if not data:
                    if firsts:
                        continue  # (another relay's answer is coming)
                    raise ConnectionError("no relay serves this worker's dumps")
                total += len(data)
                if overflow or total > budget:
                    raise Malformed(f"dump larger than its budget ({budget} bytes: twice the index's cap)")
                c = parse_dump_chunk(data, max_chunk)
                if c.epoch not in firsts and len(firsts) >= 2:
                    ignored += 1  # a third relay's (a rolling update with a surge of two): two are enough
                    continue
                first = firsts.setdefault(c.epoch, c)
                if (c.worker_id, c.seq, c.count) != (worker_id, first.seq, first.count):
                    raise Malformed("dump chunks disagree (worker, seq or count)")
                got_epoch = chunks.setdefault(c.epoch, {})
                if c.index in got_epoch:
                    raise Malformed("dump chunk repeated")
                got_epoch[c.index] = c
                if len(got_epoch) == first.count:
                    if len(firsts) > 1 and (st := self._streams.get(worker_id)) is not None:
                        st.stats.other_relay += ignored + sum(len(v) for e, v in chunks.items() if e != c.epoch)
                    return [got_epoch[i] for i in range(first.count)]
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _load(self, st: _Stream, chunks: list[DumpChunk], direct: dict[int | None, int] | None = None) -> bool:
        """Load a dump in place of the worker's entries, or on top of them (True) where it comes from a relay
        whose history begins after what they hold (`_merges`). ``direct``: the fallback's positions, read as its
        sockets closed (None: the worker was not on its direct events)."""
        s = st.stats
        first = chunks[0]
        wid = st.worker_id
        held = st.engine_seq if direct is None else direct
        merged = self._merges(st, first, held, direct is not None)
        if merged is None:
            self.idx.clear_worker(wid)
        else:
            s.dumps_merged += 1
            s.carried_missed += merged
            log.info("kv plane: %s: the dump of relay epoch %s begins after the picker's entries (engine seqs %s "
                     "-> %s): loaded on top of them", wid, first.epoch, held, first.first_seqs)
        blocks = 0
        for c in chunks:
            blocks += load_slots(self.idx, wid, first.block_size, first.size_source,
                                 [(x.rank, x.block_size, x.engine, x.ours) for x in c.slots], first.dialect)
        s.dumps += 1
        s.dump_blocks = blocks
        # the dump is this worker's replay: counted as one batch, so readiness (`KvRouting.warm`: a first
        # batch is in) sees the worker warm at once, as after an engine replay
        self.idx.stats(wid).batches += 1
        if s.fallback:
            s.fallback = False
            s.recoveries += 1
            log.info("kv plane: %s back on the plane (dump of %d blocks at seq %d)", wid, blocks, first.seq)
        s.epoch, s.seq, s.mode = first.epoch, first.seq, "live"
        self._follow(st)
        if merged is None:
            st.engine_seq, st.carry_checked = dict(first.engine_seqs), None
        else:  # a rank the new relay has said nothing of yet is checked at its first batch, as in a carry
            assert first.first_seqs is not None
            st.engine_seq = {**held, **first.engine_seqs}
            unchecked = held.keys() - first.first_seqs.keys()
            st.carry_checked, st.overlapped = (set(first.first_seqs) if unchecked else None), direct is not None
        buffered, st.buffer = st.buffer, deque()
        for m in buffered:
            if s.mode != "live":
                st.buffer.append(m)  # a gap in the buffer started another dump: keep the rest for it
            else:
                self._on_live(st, m)
                s.messages -= 1  # counted when it arrived
        return merged is not None

    @staticmethod
    def _merges(st: _Stream, first: DumpChunk, held: dict[int | None, int], followed: bool) -> int | None:
        """Whether a dump goes on top of the worker's entries: the engine batches neither covers (counted in
        ``carried_missed``), or None to replace them. On top only when the dump comes from another relay process
        than the one the entries were last following (the same relay saw everything since it started: its dump
        is the truth) and, per rank, the relay's history begins where the entries end, within `FAR_JUMP` (a rank
        it has nothing of since it started is kept, and checked at its first batch).
        Entries the picker followed from the plane must end before the relay's first batch: a first batch at or
        before their end may be another engine process's numbering, as in `_check_carry`. Entries built from the
        direct events up to this dump (``followed``) may also overlap the relay's history: they followed the
        same engine until now, restarts included. What the lost batches removed stays as stale credit, as after
        a carried restart; a dump of an earlier relay has no first seqs and replaces, as before."""
        if first.first_seqs is None or first.epoch == st.stats.epoch or not held:
            return None
        missed = 0
        for rank in held.keys() & first.first_seqs.keys():
            last, begins = held[rank], first.first_seqs[rank]
            if begins - last > FAR_JUMP or (begins <= last and not followed):
                return None
            missed += max(0, begins - last - 1)
        return missed

    # ------------------------------------------------------------- fallback
    def _fall_back(self, st: _Stream, why: str, quiet: bool = False) -> None:
        s = st.stats
        if s.fallback:
            return
        s.fallback = True
        s.fallbacks += 1
        if s.mode == "live":
            s.mode = "wait"
        (log.debug if quiet else log.warning)("kv plane: %s falls back to %s: %s", st.worker_id,
                    "its direct ZeroMQ events" if self.fallback_mode == "zmq" else "load-only routing", why)
        self._spawn(self._engage(st))

    async def _engage(self, st: _Stream) -> None:
        async with st.lock:
            if not st.stats.fallback or self._streams.get(st.worker_id) is not st:
                return
            st.engine_seq.clear()  # fed off the plane from here: the next dump says where it stands
            if self.fallback_mode == "zmq" and st.sources:
                await self.fallback.add(st.worker_id, st.sources)
            else:
                self.idx.clear_worker(st.worker_id)

    async def _watch(self) -> None:
        """A worker whose relay said nothing (no batch, no heartbeat) for ``relay_stale_s`` falls back: the
        relay died, or a partition cut it (or this picker) off while the client still looks connected."""
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            now = time.monotonic()
            if not self.link.connects:  # never connected yet: fall back after the grace, all together
                late = [st for st in self._streams.values()
                        if not st.stats.fallback and now - st.last_heard > self.first_connect_grace_s]
                if late:
                    log.warning("kv plane: no NATS connection yet: %d workers use %s meanwhile", len(late),
                                "their direct ZeroMQ events" if self.fallback_mode == "zmq" else "load-only routing")
                for st in late:
                    self._fall_back(st, "NATS not reachable", quiet=True)
                continue
            for st in list(self._streams.values()):
                if not st.stats.fallback and now - st.last_heard > self.relay_stale_s:
                    self._fall_back(st, f"nothing from its relay for {now - st.last_heard:.1f}s")
                    if st.stats.mode == "dumping" and st.dump_task is not None and not st.dump_task.done():
                        continue
                    st.stats.mode = "wait"

    def totals(self) -> dict[str, int]:
        keys = ("messages", "gaps", "dropped_batches", "relay_restarts", "dumps", "dump_failures", "dumps_refused",
                "buffer_overflows", "oversized", "fallbacks", "recoveries", "carried", "carried_missed",
                "carry_cleared", "dumps_merged", "other_relay")
        out = {k: sum(getattr(st.stats, k) for st in self._streams.values()) for k in keys}
        out["fallback_workers"] = sum(1 for st in self._streams.values() if st.stats.fallback)
        out["garbage"] = self.garbage
        return out


class _PlaneCollector(Collector):
    def __init__(self, plane: PlaneSubscribers) -> None:
        self.plane = plane

    def collect(self) -> list[Metric]:
        t = self.plane.totals()
        out: list[Metric] = []
        for key, text in (("fallbacks", "Workers that fell back off the NATS plane (direct ZeroMQ or load-only)"),
                          ("recoveries", "Workers brought back onto the plane by a dump"),
                          ("dumps", "Relay dumps loaded"), ("dump_failures", "Dumps that timed out or failed"),
                          ("dumps_refused", "Malformed dumps refused"),
                          ("garbage", "Malformed messages on the plane's subjects refused"),
                          ("gaps", "Sequence gaps on the plane"), ("relay_restarts", "Relay restarts seen"),
                          ("carried", "Relay restarts followed without a dump, the worker's entries kept"),
                          ("carried_missed", "Engine batches no relay published across carried restarts"),
                          ("carry_cleared", "Ranks cleared at a carried restart (another engine, or no position)"),
                          ("dumps_merged", "A new relay's dumps loaded on top of the worker's entries"),
                          ("other_relay", "Messages of a second relay for a worker, ignored while the followed "
                                          "one is heard"),
                          ("messages", "Live messages received")):
            m = CounterMetricFamily(f"epp_kv_plane_{key}", text)
            m.add_metric([], t[key])
            out.append(m)
        g = GaugeMetricFamily("epp_kv_plane_fallback_workers", "Workers fed off the plane right now")
        g.add_metric([], t["fallback_workers"])
        out.append(g)
        c = GaugeMetricFamily("epp_kv_plane_connected", "1 while the picker's NATS link is up")
        c.add_metric([], 1 if self.plane.link.connected else 0)
        out.append(c)
        return out

