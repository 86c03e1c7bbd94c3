"""Replica sync over NATS subjects (`--replica-sync-plane nats`, issue 47): the gRPC mesh's alternative.

Why: the mesh (adapters/replica_sync.py) is N x (N-1) streams that every replica dials itself; with a NATS
server already there for the KV events, each replica publishes once on its own subject and subscribes once to
the pool's, and needs no peer discovery at all (a replica appears by publishing, leaves by going silent).

The messages are the mesh's own protobufs (`pb.Snapshot`, `pb.Batch` inside a `pb.SyncRequest`), in an envelope
naming the replica, its incarnation (random per start) and the batch sequence: core NATS is at most once, so
a receiver that sees a sequence gap, a new incarnation or a replica it does not know asks that replica for a
snapshot (on `<prefix>.<pool>.want`), which replaces everything it held from it, as the mesh's reconnect does.
Liveness and expiry are the mesh's: a replica silent for ``peer_timeout_s`` (it heartbeats every
``heartbeat_s``) keeps its bookings ``expiry_s`` more, then they are dropped. Bounded: ``max_backlog`` changes
queued while NATS is down (past it they are dropped and the next connect sends a snapshot instead), batches
of at most MAX_BATCH_ITEMS, predictions cut as the mesh cuts them, a malformed message refused and counted.
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter

from epp_extproc.adapters.replica_sync import (
    _KIND_TO_PB,
    MAX_BATCH_ITEMS,
    LoadsSink,
    SyncItem,
    SyncMetrics,
    apply_batch,
    default_replica_id,
    fill_batch,
)
from epp_extproc.adapters.worker_facts import PredictionSink
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.load import BookingChange, HeldBooking, LoadTracker
from epp_extproc.kvplane.link import NatsLink
from epp_extproc.kvplane.wire import worker_token
from epp_extproc.proto_gen.epp.v1 import replica_sync_pb2 as pb
from kvindex.aio import cancel_and_wait

if TYPE_CHECKING:
    from epp_extproc.tracing.spans import PublishSpan, Tracing

log = logging.getLogger(__name__)

MAGIC = b"KVS1"
_HDR = struct.Struct(">4sQQH")  # magic, incarnation, seq, replica id length
MAX_ID = 256
SNAPSHOT_MIN_INTERVAL_S = 0.2  # a replica asked for its snapshot by many peers at once sends one


def encode(replica_id: str, incarnation: int, seq: int, msg: pb.SyncRequest) -> bytes:
    rid = replica_id.encode()
    return _HDR.pack(MAGIC, incarnation, seq, len(rid)) + rid + msg.SerializeToString()


def decode(data: bytes, max_bytes: int) -> tuple[str, int, int, pb.SyncRequest] | None:
    """(replica id, incarnation, seq, message) or None for anything malformed."""
    if len(data) < _HDR.size or len(data) > max_bytes:
        return None
    magic, inc, seq, n = _HDR.unpack_from(data)
    if magic != MAGIC or not 0 < n <= MAX_ID or len(data) < _HDR.size + n:
        return None
    try:
        rid = data[_HDR.size:_HDR.size + n].decode()
        msg = pb.SyncRequest.FromString(data[_HDR.size + n:])
    except Exception:
        return None
    if not (msg.HasField("snapshot") or msg.HasField("batch")):
        return None
    return rid, inc, seq, msg


@dataclass(slots=True)
class _Peer:
    incarnation: int
    seq: int | None = None
    snapshot_at: float | None = None
    last_heard: float = 0.0
    expiry: asyncio.TimerHandle | None = None
    connected: bool = True


class NatsReplicaSync:
    """`ReplicaSync`'s interface for the app (start, close, settled, on_predict, set_peers, snapshot)."""

    tls = None  # TLS is the NATS connection's (nats:// or tls:// URLs), not this module's

    def __init__(self, load: LoadTracker, registry: EndpointRegistry, *, servers: Sequence[str], pool: str = "default",
                 prefix: str = "epp.sync", index: PredictionSink | None = None, replica_id: str | None = None,
                 heartbeat_s: float = 0.5, peer_timeout_s: float = 2.0, expiry_s: float = 5.0,
                 max_backlog: int = 100_000, max_message_bytes: int = 8 * 1024 * 1024,
                 metrics_registry: CollectorRegistry | None = None, tracing: Tracing | None = None,
                 linger_s: float = 0.0) -> None:
        """`tracing` (None: off) records a sampled request's booking on its way to the subject, and each
        peer's snapshot loaded here. `linger_s` (`--replica-sync-linger-ms`): how long the first change of a
        batch waits for others before it is published (0: at once)."""
        self.load = load
        self.tracing = tracing
        self.registry = registry
        self.index = index
        self.replica_id = replica_id or default_replica_id()
        self.incarnation = random.getrandbits(63)
        self.heartbeat_s = heartbeat_s
        self.linger_s = linger_s
        self.peer_timeout_s = peer_timeout_s
        self.expiry_s = expiry_s
        self.max_backlog = max_backlog
        self.max_message_bytes = max_message_bytes
        self.subject = f"{prefix}.{pool}.r.{worker_token(self.replica_id)}"
        self.subject_all = f"{prefix}.{pool}.r.*"
        self.subject_want = f"{prefix}.{pool}.want"
        reg = metrics_registry or CollectorRegistry()
        self.metrics = SyncMetrics(reg)
        self.refused = Counter("epp_replica_sync_nats_refused", "Malformed replica-sync messages refused",
                               registry=reg)
        self.gaps = Counter("epp_replica_sync_nats_gaps", "Sequence gaps or unknown peers answered by a snapshot",
                            registry=reg)
        # no_echo: every replica subscribes to the pool's subjects, its own among them. With echo the server
        # sent each of our batches back to us, and we read and parsed it only to drop it: a third of all the
        # sync's receive work with 3 replicas, on the CPU that Envoy and the workers share on one host
        # (issue 47: the synced replicas' TTFT p50 at 5 req/s).
        self.link = NatsLink(servers, f"sync-{self.replica_id}", on_up=self._on_up, on_down=lambda: None,
                             no_echo=True)
        self.peers: dict[str, _Peer] = {}
        self._pending: list[SyncItem] = []
        self._loads: dict[str, pb.WorkerLoad] = {}  # worker samples for the next batch, the latest per worker
        self.on_loads: LoadsSink | None = None  # the peers' worker samples (--replica-sync-share-metrics)
        self._traced: list[tuple[int, PublishSpan]] = []  # (position in `_pending`, span): sampled bookings only
        self._oldest_unix = 0.0
        self._need_snapshot = True
        self._last_snapshot = 0.0
        self._seq = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []
        self._wants: set[asyncio.Task[None]] = set()  # snapshot requests sent for gaps seen in the read loop
        self._started_at: float | None = None
        load.add_listener(self._on_change)
        load.add_first_chunk_forwarder(self._forward_first_chunk)

    # ------------------------------------------------------------ local changes
    def _queue(self, item: SyncItem, pub: PublishSpan | None = None) -> None:
        if not self._pending:
            self._oldest_unix = time.time()
        self._pending.append(item)
        if pub is not None:
            pub.queued()
            self._traced.append((len(self._pending) - 1, pub))
        if len(self._pending) > self.max_backlog:  # NATS down for long: a snapshot will say it all
            self._pending.clear()
            self._drop_traced("backlog over its cap while NATS was away: a snapshot follows")
            self._need_snapshot = True
        self._wake.set()

    def _drop_traced(self, why: str) -> None:
        traced, self._traced = self._traced, []
        for _, pub in traced:
            pub.dropped(why)

    def _on_change(self, ch: BookingChange) -> None:
        d = pb.BookingDelta(kind=_KIND_TO_PB[ch.kind], id=ch.id, address=ch.address)
        pub = None
        if ch.kind == "book":
            d.prefill_blocks = ch.prefill_blocks
            d.decode_blocks = ch.decode_blocks
            if self.tracing is not None:  # a span only when the booking's request is sampled
                pub = self.tracing.publish("nats", self.subject)
                if pub is not None:
                    pub.attrs["epp.replica_sync.peers"] = sum(1 for p in self.peers.values() if p.connected)
        self._queue(d, pub)

    def _forward_first_chunk(self, owner: str | None, booking_id: str) -> None:
        """Lean mode's first chunk of another replica's booking came to us: published with our next batch
        (every replica hears it; only the one that made the booking acts on it)."""
        self._queue(booking_id)
        self.metrics.first_chunks.labels("forwarded").inc()

    def on_predict(self, address: str, block_size: int, hashes: Sequence[int], ttl_s: float) -> None:
        if hashes:
            self._queue(pb.Prediction(address=address, block_size=block_size, hashes=hashes,
                                      ttl_ms=int(ttl_s * 1000)))

    def offer_loads(self, loads: Sequence[pb.WorkerLoad]) -> None:
        """This replica's worker samples (`MetricsShare`): they ride in the next batch and wake nothing."""
        for wl in loads:
            self._loads[wl.address] = wl

    def kick(self) -> None:
        if self._pending or self._loads:
            self._wake.set()

    def live_replicas(self) -> list[str]:
        """The peers heard within the peer timeout (`MetricsShare`'s owners)."""
        return [rid for rid, p in self.peers.items() if p.connected]

    # ------------------------------------------------------------ lifecycle
    def set_peers(self, targets: Iterable[str]) -> None:
        """No peer list on NATS: replicas find each other on the pool's subject."""

    async def start(self, listen: Sequence[str] = ()) -> None:
        self._started_at = time.monotonic()
        self.link.start()
        self._tasks = [asyncio.create_task(self._sender(), name="replica-sync-nats-send"),
                       asyncio.create_task(self._watch(), name="replica-sync-nats-watch")]

    async def close(self, flush_s: float = 0.5) -> None:
        """Push what is queued (the frees of a drain), then stop."""
        if self._pending and self.link.connected:
            self._wake.set()
            deadline = time.monotonic() + flush_s
            while self._pending and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if self.link.nc is not None:
                try:
                    async with asyncio.timeout(max(0.05, deadline - time.monotonic())):
                        await self.link.nc.flush()
                except Exception:
                    pass
        await cancel_and_wait([*self._tasks, *self._wants])
        for p in self.peers.values():
            if p.expiry is not None:
                p.expiry.cancel()
        await self.link.close()

    def settled(self) -> bool:
        """Connected and, for one peer timeout after that, listening: every live peer heartbeats within it,
        and a peer first heard is asked its snapshot at once."""
        if self._started_at is None or not self.link.connected:
            return self._started_at is not None and time.monotonic() - self._started_at > self.peer_timeout_s
        return all(p.snapshot_at is not None for p in self.peers.values() if p.connected) and \
            time.monotonic() - self._started_at > min(self.peer_timeout_s, 1.0)

    async def _on_up(self) -> None:
        nc = self.link.nc
        if nc is None:
            return
        if not self._subs:
            # handled in the client's read loop (NatsLink.subscribe_direct), as the KV plane's messages are:
            # nats-py's own callback path costs a queue, a task switch and a Msg object per message
            self._subs = [await self.link.subscribe_direct(self.subject_all, self._on_data,
                                                           pending_msgs_limit=100_000,
                                                           pending_bytes_limit=64 * 1024 * 1024),
                          await nc.subscribe(self.subject_want, cb=self._on_want)]
        self._need_snapshot = True  # whatever was missed while away: the snapshot says it
        self._wake.set()

    # ------------------------------------------------------------ outbound
    async def _publish(self, msg: pb.SyncRequest, seq: int) -> bool:
        nc = self.link.nc
        if nc is None or not nc.is_connected:
            return False
        try:
            await nc.publish(self.subject, encode(self.replica_id, self.incarnation, seq, msg))
            return True
        except Exception as exc:
            log.debug("replica sync over NATS: publish failed: %s", exc)
            return False

    async def _send_snapshot(self) -> None:
        self._need_snapshot = False
        self._last_snapshot = time.monotonic()
        self._pending.clear()  # the snapshot carries their effect on the bookings; predictions are short-lived
        traced, self._traced = self._traced, []
        snap = pb.SyncRequest(snapshot=pb.Snapshot(bookings=[
            pb.Booking(id=b.id, address=b.address, prefill_blocks=b.prefill_blocks,
                           decode_blocks=b.decode_blocks, prefilling=b.prefilling) for b in self.load.bookings()]))
        ok = await self._publish(snap, self._seq)
        if not ok:
            self._need_snapshot = True
        for _, pub in traced:
            if ok:
                pub.sent("snapshot")
            else:
                pub.dropped("the snapshot carrying it was not published: the next one carries it")

    async def _sender(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if not self.link.connected:
                continue
            if self.linger_s > 0 and self._pending:  # the changes of the next linger_s go in this batch too
                await asyncio.sleep(self.linger_s)
                self._wake.clear()
            if self._need_snapshot and time.monotonic() - self._last_snapshot >= SNAPSHOT_MIN_INTERVAL_S:
                await self._send_snapshot()
                continue
            items, self._pending = self._pending[:MAX_BATCH_ITEMS], self._pending[MAX_BATCH_ITEMS:]
            traced: list[PublishSpan] = []
            if self._traced:
                traced = [pub for i, pub in self._traced if i < MAX_BATCH_ITEMS]
                self._traced = [(i - MAX_BATCH_ITEMS, pub) for i, pub in self._traced if i >= MAX_BATCH_ITEMS]
            oldest = self._oldest_unix if items else 0.0
            if self._pending:
                self._wake.set()
                self._oldest_unix = time.time()
            self._seq += 1
            batch = pb.Batch(seq=self._seq, oldest_change_unix=oldest)
            fill_batch(batch, items)
            if self._loads:
                batch.loads.extend(self._loads.values())
                self._loads.clear()
            ok = await self._publish(pb.SyncRequest(batch=batch), self._seq)
            if not ok:
                self._need_snapshot = True  # lost: the peers see the gap too and ask
            elif items:  # as the mesh counts per peer; here one publish reaches every peer ("nats")
                self.metrics.batches_sent.labels("nats").inc()
                self.metrics.changes_sent.labels("nats").inc(len(items))
            for pub in traced:
                if ok:
                    pub.sent("batch", len(items))
                else:
                    pub.dropped("the batch carrying it was not published: a snapshot follows")

    async def _on_want(self, msg: Any) -> None:
        try:
            who = msg.data.decode()
        except UnicodeDecodeError:
            return
        if who == self.replica_id:
            self._need_snapshot = True
            self._wake.set()

    # ------------------------------------------------------------- inbound
    def _on_data(self, subject: str, data: bytes) -> None:
        """One message on the pool's subjects, from the client's read loop: applied at once; a sequence gap
        or an unknown peer is answered by a snapshot request sent from a task (never awaited here)."""
        got = decode(data, self.max_message_bytes)
        if got is None:
            self.refused.inc()
            return
        rid, inc, seq, req = got
        if rid == self.replica_id:
            return  # our own
        now = time.monotonic()
        p = self.peers.get(rid)
        if p is None or p.incarnation != inc:
            if p is not None and p.expiry is not None:
                p.expiry.cancel()
            log.info("replica sync over NATS: peer %s %s", rid, "joined" if p is None else "restarted")
            p = self.peers[rid] = _Peer(inc)
        if p.expiry is not None:
            p.expiry.cancel()
            p.expiry = None
        p.connected = True
        p.last_heard = now
        if req.HasField("snapshot"):
            start_ns = time.time_ns()
            starting = self.tracing is not None and not self.settled()
            self.load.peer_snapshot(rid, (HeldBooking(b.id, b.address, b.prefill_blocks, b.decode_blocks,
                                                      b.prefilling) for b in req.snapshot.bookings))
            p.snapshot_at, p.seq = now, seq
            if self.tracing is not None:
                self.tracing.snapshot_loaded("nats", rid, len(req.snapshot.bookings), start_ns,
                                             during_start=starting, subject=subject)
        else:
            if p.seq is None or seq != p.seq + 1:
                self.gaps.inc()
                task = asyncio.get_running_loop().create_task(self._want(rid))
                self._wants.add(task)
                task.add_done_callback(self._wants.discard)
            p.seq = seq
            apply_batch(self.load, self.registry, self.index, rid, req.batch, self.metrics, self.on_loads)
            if req.batch.oldest_change_unix > 0:
                self.metrics.visible_lag.observe(max(time.time() - req.batch.oldest_change_unix, 0.0))
        self.metrics.peer_bookings.labels(rid).set(self.load.peer_inflight(rid))

    async def _want(self, rid: str) -> None:
        nc = self.link.nc
        if nc is not None and nc.is_connected:
            try:
                await nc.publish(self.subject_want, rid.encode())
            except Exception as exc:
                log.debug("replica sync over NATS: snapshot request failed: %s", exc)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.05, self.heartbeat_s / 2))
            now = time.monotonic()
            for rid, p in list(self.peers.items()):
                if p.connected and now - p.last_heard > self.peer_timeout_s:
                    p.connected = False
                    log.info("replica sync over NATS: peer %s silent; its %d bookings expire in %.1fs", rid,
                             self.load.peer_inflight(rid), self.expiry_s)
                    p.expiry = loop.call_later(self.expiry_s, self._expire, rid, p)

    def _expire(self, rid: str, p: _Peer) -> None:
        if self.peers.get(rid) is not p or p.connected:
            return
        n = self.load.drop_peer(rid)
        del self.peers[rid]
        self.metrics.peers_expired.inc()
        self.metrics.bookings_expired.inc(n)
        log.warning("replica sync over NATS: peer %s did not come back; dropped its %d bookings", rid, n)

    def snapshot(self) -> dict[str, object]:
        return {"replica_id": self.replica_id, "plane": "nats", "connected": self.link.connected,
                "settled": self.settled(),
                "peers": {r: {"connected": p.connected, "bookings": self.load.peer_inflight(r), "seq": p.seq}
                          for r, p in self.peers.items()}}
