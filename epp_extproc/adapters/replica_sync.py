"""Replica sync: picker replicas share their bookings and predictions over the `epp.v1.ReplicaSync` service.

Each replica runs the service (inbound: peers push their state to us) and one outbound link per peer (we push
ours). A link opens a Sync stream, sends Hello + a Snapshot of every local booking, then batches of the
booking changes and predictions made since; it reconnects with a fresh snapshot after any failure. Batching:
changes made while a batch is being written wait for the next one, so a busy replica sends few large
messages and an idle one sends each change at once. An empty batch every `heartbeat_s` keeps a quiet stream
provably alive.

Inbound, a peer that stays silent for `peer_timeout_s`, or whose stream ends, is gone: its bookings are
kept for `expiry_s` (its requests may still be running on the workers) and then dropped, unless it came
back first, in which case its new snapshot replaced them. Nothing a peer sends is relayed further.

Lag: the receiver measures "changed there -> applied here" (`epp_replica_sync_visible_lag_seconds`) from the
sender's wall-clock stamp of each batch's oldest change (exact on one host); the sender measures the round
trip to the peer's ack on its own clock (`epp_replica_sync_lag_seconds`, sampled: acks are cumulative and
sent at most every ACK_INTERVAL_S, plus one per heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp_extproc.adapters.worker_facts import PredictionSink
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.load import BookingChange, HeldBooking, LoadTracker
from epp_extproc.file_watch import FileWatch, file_stamp
from epp_extproc.proto_gen.epp.v1 import replica_sync_pb2 as pb
from epp_extproc.proto_gen.epp.v1 import replica_sync_pb2_grpc as pb_grpc
from epp_extproc.tls_files import check_pair
from kvindex.aio import cancel_and_wait
from kvindex.backoff import Backoff

if TYPE_CHECKING:
    from epp_extproc.tracing.spans import PublishSpan, Tracing

log = logging.getLogger(__name__)

_KIND_TO_PB = {"book": pb.BookingDelta.BOOK, "prefill_done": pb.BookingDelta.PREFILL_DONE,
               "move": pb.BookingDelta.MOVE, "free": pb.BookingDelta.FREE}
_PB_TO_KIND = {v: k for k, v in _KIND_TO_PB.items()}
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
MAX_BATCH_ITEMS = 4096  # per message; a longer backlog goes out as several batches
# Acks are sampled: a heartbeat is always acked, a batch only if the last ack is this old. Each gRPC message
# costs ~0.1 ms of Python in both processes, so acking every batch doubled the sync traffic for nothing
# but liveness and a lag sample. A sender with unacked batches heartbeats after ACK_INTERVAL_S.
ACK_INTERVAL_S = 0.02
MAX_PREDICTION_HASHES = 8192  # a peer's prediction longer than this is cut (bounded work per message)
MAX_PREDICTION_TTL_S = 60.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a snapshot of 100k bookings fits with room to spare
RECONNECT_INITIAL_S = 0.05  # a link's reconnect schedule (kvindex.backoff): a restarted peer is back soon
RECONNECT_MAX_S = 2.0
STOP_RECANCEL_S = 1.0  # a link's stop: how long each cancel is waited for, and how many more are sent
STOP_RECANCELS = 5


TLS_FILES = ("tls.crt", "tls.key", "ca.crt")


def _read_set(d: str) -> tuple[bytes, bytes, bytes]:
    """(cert, key, ca) from d, checked: PEM that loads, and the key is the certificate's (else ValueError)."""
    from cryptography import x509

    parts = []
    for f in TLS_FILES:
        with open(os.path.join(d, f), "rb") as fh:
            parts.append(fh.read())
    cert_pem, key_pem, ca_pem = parts
    check_pair(cert_pem, key_pem)
    try:
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError as e:
        raise ValueError(f"ca.crt does not load as PEM: {e}") from None
    return cert_pem, key_pem, ca_pem


class SyncTls:
    """Mutual TLS for sync over TCP: every replica presents the shared certificate and accepts only peers
    whose certificate the shared CA signed (a plaintext or foreign peer cannot push bookings).

    The files are re-read when they change (`run`: a renewed Secret, kubelet swapping its `..data` link): new
    inbound handshakes get the new pair and CA through grpcio's dynamic server credentials, new outbound
    sessions build their channel from the new ones; established streams keep theirs. A set that does not load
    (half-written, key not the certificate's) is logged and the previous one stays in service."""

    def __init__(self, cert_pem: bytes, key_pem: bytes, ca_pem: bytes, server_name: str,
                 path: str | None = None, *, poll_interval_s: float = 1.0) -> None:
        self.cert_pem, self.key_pem, self.ca_pem = cert_pem, key_pem, ca_pem
        self.server_name = server_name  # peers are dialled by IP: the name their certificate is checked against
        self.path = path
        self.poll_interval_s = poll_interval_s
        self.reloads = 0
        self._pending = False  # a new set the server's credentials have not fetched yet
        self._watch: FileWatch[tuple[bytes, bytes, bytes]] | None = None
        if path:
            paths = [os.path.join(path, f) for f in TLS_FILES]
            self._watch = FileWatch(paths, lambda: _read_set(path), self._put_in_service, on_error=self._refused,
                                    interval_s=poll_interval_s, retry_failed=True, stamp=file_stamp(paths))

    @classmethod
    def load(cls, path: str, server_name: str, **kw: float) -> SyncTls:
        d = os.path.abspath(path)
        missing = [f for f in TLS_FILES if not os.path.isfile(os.path.join(d, f))]
        if missing:
            raise ValueError(f"DYN_EPP_REPLICA_SYNC_TLS_PATH={path!r} lacks {', '.join(missing)}")
        try:
            cert, key, ca = _read_set(d)
        except ValueError as e:
            raise ValueError(f"DYN_EPP_REPLICA_SYNC_TLS_PATH={path!r}: {e}") from None
        return cls(cert, key, ca, server_name, d, **kw)

    def server_credentials(self) -> grpc.ServerCredentials:
        # grpcio calls the fetch function on each new handshake (from its own thread): it only hands over a
        # set the poller already read and checked, so a handshake never does file I/O
        return grpc.dynamic_ssl_server_credentials(self._config(), self._fetch, require_client_authentication=True)

    def _config(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key_pem, self.cert_pem)],
                                                         root_certificates=self.ca_pem)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        if not self._pending:
            return None
        self._pending = False
        return self._config()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    async def check_once(self) -> bool:
        """Reload when the files changed; True when a new set was put in service."""
        return False if self._watch is None else await self._watch.check()

    def _refused(self, e: Exception) -> None:
        # the version is read again at the next poll (retry_failed): a half-written Secret completes
        log.warning("replica sync TLS files in %s changed but do not load (%s); keeping the previous ones",
                    self.path, e)

    def _put_in_service(self, new: tuple[bytes, bytes, bytes]) -> bool:
        if new == (self.cert_pem, self.key_pem, self.ca_pem):
            return False
        self.cert_pem, self.key_pem, self.ca_pem = new
        self._pending = True
        self.reloads += 1
        log.info("replica sync TLS reloaded from %s; new connections use it", self.path)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.check_once()


def default_replica_id() -> str:
    """POD_NAME on Kubernetes (stable across a container restart, so the restarted replica's snapshot
    replaces its old bookings at once), else host-pid-random: unique even for pickers sharing a process."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}-{random.getrandbits(24):06x}"


class SyncMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.lag = Histogram("epp_replica_sync_lag_seconds", "Booking change on this replica -> acked by a "
                             "peer (oldest change of each batch; sender's clock, includes the ack's way back)",
                             ["peer"], buckets=LAG_BUCKETS, registry=r)
        self.visible_lag = Histogram("epp_replica_sync_visible_lag_seconds", "Change made on a peer -> applied "
                                     "here (oldest change of each batch; the peer's wall clock vs ours)",
                                     buckets=LAG_BUCKETS, registry=r)
        self.batches_sent = Counter("epp_replica_sync_batches_sent", "Batches pushed to peers", ["peer"],
                                    registry=r)
        self.changes_sent = Counter("epp_replica_sync_changes_sent", "Booking changes and predictions pushed "
                                    "to peers", ["peer"], registry=r)
        self.connects = Counter("epp_replica_sync_connects", "Outbound sync streams opened (each starts with "
                                "a snapshot)", ["peer"], registry=r)
        self.link_up = Gauge("epp_replica_sync_link_up", "1 while the outbound stream to a peer is up",
                             ["peer"], registry=r)
        self.overflows = Counter("epp_replica_sync_overflows", "Outbound backlog over its cap: the stream "
                                 "was reset and resynced with a snapshot", ["peer"], registry=r)
        self.peer_bookings = Gauge("epp_replica_peer_bookings", "Bookings held for each peer replica",
                                   ["replica"], registry=r)
        self.peers_expired = Counter("epp_replica_peer_expired", "Peers whose bookings were dropped after "
                                     "they went away", registry=r)
        self.bookings_expired = Counter("epp_replica_peer_bookings_expired", "Bookings dropped because "
                                        "their replica went away", registry=r)
        self.first_chunks = Counter("epp_replica_sync_first_chunks", "Lean mode's first-chunk signals of "
                                    "another replica's booking: sent on to it (forwarded), and received for one "
                                    "of ours (applied: its prefill ended here)", ["direction"], registry=r)


# what a batch carries, in order: booking changes, predictions, and (a str) the booking id of a forwarded
# first-chunk signal (`Batch.first_chunks`)
SyncItem = pb.BookingDelta | pb.Prediction | str


def fill_batch(batch: pb.Batch, items: Iterable[SyncItem]) -> None:
    """Put queued items in their fields of `batch` (either plane)."""
    for it in items:
        if isinstance(it, pb.BookingDelta):
            batch.deltas.append(it)
        elif isinstance(it, str):
            batch.first_chunks.append(it)
        else:
            batch.predictions.append(it)


# a peer's worker samples (--replica-sync-share-metrics) go to this: (peer, samples)
LoadsSink = Callable[[str, Sequence[pb.WorkerLoad]], None]


@dataclass(slots=True)
class _Outgoing:
    items: list[SyncItem] = field(default_factory=list)
    oldest: float = 0.0  # monotonic
    oldest_unix: float = 0.0
    # worker samples waiting for a batch (the latest per worker): they ride along, `kick` sends them alone
    loads: dict[str, pb.WorkerLoad] = field(default_factory=dict)
    # (position in `items`, its span) of the bookings of sampled requests; None (no list made) for the rest
    traced: list[tuple[int, PublishSpan]] | None = None

    def drop_traced(self, why: str) -> None:
        """These bookings will not go out in a batch (the next snapshot carries them): their spans say so."""
        traced, self.traced = self.traced, None
        for _, pub in traced or ():
            pub.dropped(why)


class _Session:
    """One Sync stream's own queue. A new stream gets a new one, so the request generator of a stream that
    already failed (gRPC may still be pulling it) can never take changes meant for the next stream."""

    __slots__ = ("pending", "wake", "acks", "seq", "open", "reset", "kicked")

    def __init__(self) -> None:
        self.pending = _Outgoing()
        self.wake = asyncio.Event()
        self.acks: dict[int, float] = {}  # seq -> creation time (monotonic) of the batch's oldest change
        self.seq = 0
        self.open = False  # the snapshot is out: changes from now on go into `pending`
        self.reset = False
        self.kicked = False  # worker samples are queued and due: send them even with no change

    def close(self) -> None:
        self.open = False
        self.reset = True
        self.wake.set()
        self.pending.drop_traced("the stream ended before it was sent: the next stream's snapshot carries it")


class PeerLink:
    """Our push stream to one peer: Hello, Snapshot, then batches; reconnects (with a new snapshot) forever."""

    def __init__(self, sync: ReplicaSync, target: str) -> None:
        self.sync = sync
        self.target = target
        self.peer_id: str | None = None  # from the peer's Hello
        self.attempts = 0
        self.failures = 0
        self.handshake_at: float | None = None  # monotonic time of the last Hello received
        self._cur: _Session | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def up(self) -> bool:
        return self._cur is not None and self._cur.open

    @property
    def settled(self) -> bool:
        """Known to be reachable (handshake done) or known to be unreachable (an attempt failed)."""
        return self.handshake_at is not None or self.failures > 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, flush_s: float = 0.0) -> None:
        """Stop, after up to `flush_s` for what is queued to be sent and acked."""
        deadline = time.monotonic() + flush_s
        while (cur := self._cur) is not None and cur.open and (cur.pending.items or cur.acks) and \
                time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        # Python 3.11's `asyncio.timeout` turns a cancel that lands in the instant its own deadline fires into
        # TimeoutError: the link took that for a failed stream and reconnected, and this stop waited for it
        # forever (seen once in CI, a test's teardown hung). So the loop also checks `_stopping`, and a cancel
        # that was swallowed is sent again.
        self._stopping = True
        left = await cancel_and_wait([self._task], timeout=STOP_RECANCEL_S)
        for _ in range(STOP_RECANCELS):
            if not left:
                break
            left = await cancel_and_wait(left, timeout=STOP_RECANCEL_S)
        if left:
            log.warning("replica sync to %s: the link did not stop after %d cancels; left running", self.target,
                        STOP_RECANCELS + 1)
        self.sync.metrics.link_up.labels(self.target).set(0)

    def offer(self, item: SyncItem, pub: PublishSpan | None = None) -> None:
        """Queue a change for the next batch; `pub`: the span of a sampled request's booking (ended when the
        batch carrying it is handed to the stream)."""
        cur = self._cur
        if cur is None or not cur.open:
            return  # the snapshot on (re)connect carries the state; predictions are short-lived anyway
        p = cur.pending
        if not p.items:
            p.oldest, p.oldest_unix = time.monotonic(), time.time()
        p.items.append(item)
        if pub is not None:
            pub.queued()
            if p.traced is None:
                p.traced = []
            p.traced.append((len(p.items) - 1, pub))
        if len(p.items) > self.sync.max_backlog:
            self.sync.metrics.overflows.labels(self.target).inc()
            log.warning("replica sync to %s: %d changes backlogged; resetting the stream (a snapshot follows)",
                        self.target, len(p.items))
            p.drop_traced("backlog over its cap: the stream resets and a snapshot follows")
            cur.pending = _Outgoing()
            cur.close()
            return
        cur.wake.set()

    def offer_loads(self, loads: Sequence[pb.WorkerLoad]) -> None:
        """Worker samples for the next batch: they wake nothing (`kick` does)."""
        cur = self._cur
        if cur is not None and cur.open:
            for wl in loads:
                cur.pending.loads[wl.address] = wl

    def kick(self) -> None:
        cur = self._cur
        if cur is not None and cur.open and (cur.pending.items or cur.pending.loads):
            cur.kicked = True
            cur.wake.set()

    async def _run(self) -> None:
        backoff = Backoff(RECONNECT_INITIAL_S, RECONNECT_MAX_S)
        while not self._stopping:
            self.attempts += 1
            session = self._cur = _Session()
            was_up = False
            try:
                await self._session(session)
                backoff.succeeded()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                was_up = session.open
                self.failures += 1
                log.log(logging.INFO if self.failures == 1 or was_up else logging.DEBUG,
                        "replica sync to %s failed: %s", self.target, _short(e))
            finally:
                session.close()
                if self._cur is session:
                    self._cur = None
            self.sync.metrics.link_up.labels(self.target).set(0)
            if self._stopping:
                return
            if was_up:
                backoff.succeeded()  # a stream that worked: retry at once-ish, the peer probably restarted
            await asyncio.sleep(backoff.failed())

    async def _session(self, session: _Session) -> None:
        opts = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 1000)]
        tls = self.sync.tls
        if tls is not None and not self.target.startswith("unix:"):
            channel = grpc.aio.secure_channel(self.target, tls.channel_credentials(),
                                              options=[*opts, ("grpc.ssl_target_name_override", tls.server_name)])
        else:
            channel = grpc.aio.insecure_channel(self.target, options=opts)
        async with channel:
            stub = pb_grpc.ReplicaSyncStub(channel)
            call = stub.Sync(self._requests(session))
            async with asyncio.timeout(self.sync.peer_timeout_s):
                first = await call.read()
            if first is grpc.aio.EOF or not first.HasField("hello"):
                raise ConnectionError("peer did not answer with Hello")
            if first.hello.replica_id == self.sync.replica_id:
                raise ConnectionError("this target is ourselves")
            self.peer_id = first.hello.replica_id
            self.handshake_at = time.monotonic()
            self.sync.metrics.connects.labels(self.target).inc()
            self.sync.metrics.link_up.labels(self.target).set(1)
            log.info("replica sync to %s (%s) is up", self.target, self.peer_id)
            while True:  # heartbeats are always acked: silence means the peer or the path is gone
                async with asyncio.timeout(self.sync.peer_timeout_s):
                    msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise ConnectionError("peer closed the stream")
                if session.reset:
                    raise ConnectionResetError("backlog overflow")
                if msg.HasField("ack"):
                    self._acked(session, msg.ack.seq)

    def _acked(self, session: _Session, seq: int) -> None:
        """Acks are cumulative; only the batch that was acked itself gives a lag sample (the ones before it
        waited for a sampled ack, which says nothing about the path)."""
        now = time.monotonic()
        for s in [s for s in session.acks if s <= seq]:
            sent = session.acks.pop(s)
            if s == seq:
                self.sync.metrics.lag.labels(self.target).observe(now - sent)

    async def _requests(self, session: _Session) -> AsyncIterator[pb.SyncRequest]:
        sync = self.sync
        yield pb.SyncRequest(hello=pb.Hello(replica_id=sync.replica_id, incarnation=sync.incarnation))
        if session.reset:
            return
        # From here on every change is queued for this stream: the snapshot and the queue start at the same
        # instant (one event loop), so nothing is lost or counted twice.
        session.open = True
        yield pb.SyncRequest(snapshot=pb.Snapshot(bookings=[
            pb.Booking(id=b.id, address=b.address, prefill_blocks=b.prefill_blocks,
                       decode_blocks=b.decode_blocks, prefilling=b.prefilling) for b in sync.load.bookings()]))
        while True:
            if not session.pending.items and not session.kicked:  # samples alone wait for a kick or heartbeat
                session.wake.clear()
                idle = min(sync.heartbeat_s, ACK_INTERVAL_S) if session.acks else sync.heartbeat_s
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(idle):
                        await session.wake.wait()
            if session.reset:
                return  # this stream is over; the next one starts with its own snapshot
            if sync.linger_s > 0 and session.pending.items:  # the changes of the next linger_s go along
                await asyncio.sleep(sync.linger_s)
                if session.reset:
                    return
            pending, session.pending = session.pending, _Outgoing()
            session.kicked = False
            items, rest = pending.items[:MAX_BATCH_ITEMS], pending.items[MAX_BATCH_ITEMS:]
            if rest:
                session.pending = _Outgoing(rest, pending.oldest, pending.oldest_unix)
            sent_now = _split_traced(pending, session.pending)
            session.seq += 1
            batch = pb.Batch(seq=session.seq, oldest_change_unix=pending.oldest_unix if items else 0.0)
            fill_batch(batch, items)
            if pending.loads:
                batch.loads.extend(pending.loads.values())
            if items:
                session.acks[session.seq] = pending.oldest
                sync.metrics.batches_sent.labels(self.target).inc()
                sync.metrics.changes_sent.labels(self.target).inc(len(items))
            for pub in sent_now:  # handed to the stream (gRPC writes it before it asks for the next one)
                pub.sent("batch", len(items))
            yield pb.SyncRequest(batch=batch)


def _split_traced(taken: _Outgoing, rest: _Outgoing) -> list[PublishSpan]:
    """The traced bookings of the batch taken from `taken` (its first MAX_BATCH_ITEMS items); the others move
    to `rest`, which holds the items past them, at their new positions."""
    traced = taken.traced
    if not traced:
        return []
    taken.traced = None
    later = [(i - MAX_BATCH_ITEMS, pub) for i, pub in traced if i >= MAX_BATCH_ITEMS]
    if later:
        rest.traced = later
    return [pub for i, pub in traced if i < MAX_BATCH_ITEMS]


@dataclass
class _Inbound:
    generation: int = 0
    snapshot_at: float | None = None
    expiry: asyncio.TimerHandle | None = None
    connected: bool = False


class ReplicaSync(pb_grpc.ReplicaSyncServicer):
    """The sync service (inbound) plus the links to the current peers (outbound)."""

    def __init__(self, load: LoadTracker, registry: EndpointRegistry, *, index: PredictionSink | None = None,
                 replica_id: str | None = None, heartbeat_s: float = 0.5, peer_timeout_s: float = 2.0,
                 expiry_s: float = 5.0, max_backlog: int = 100_000,
                 metrics_registry: CollectorRegistry | None = None, tls: SyncTls | None = None,
                 tracing: Tracing | None = None, linger_s: float = 0.0) -> None:
        """`tracing` (None: off) records a sampled request's booking on its way to the peers, and each peer's
        snapshot loaded here. `linger_s` (`--replica-sync-linger-ms`): how long the first change of a batch
        waits for others before it is sent to a peer (0: at once)."""
        self.load = load
        self.tracing = tracing
        self.registry = registry
        self.index = index
        self.replica_id = replica_id or default_replica_id()
        self.incarnation = random.getrandbits(64)
        self.heartbeat_s = heartbeat_s
        self.linger_s = linger_s
        self.peer_timeout_s = peer_timeout_s
        self.expiry_s = expiry_s
        self.max_backlog = max_backlog
        self.tls = tls
        self.metrics = SyncMetrics(metrics_registry or CollectorRegistry())
        self.links: dict[str, PeerLink] = {}
        self.inbound: dict[str, _Inbound] = {}
        self._peers_known = False
        self._server: grpc.aio.Server | None = None
        self.addresses: list[str] = []
        self.on_loads: LoadsSink | None = None  # the peers' worker samples (--replica-sync-share-metrics)
        load.add_listener(self._on_change)
        load.add_first_chunk_forwarder(self._forward_first_chunk)

    # ------------------------------------------------------------------ local changes -> every link

    def _on_change(self, ch: BookingChange) -> None:
        if not self.links:
            return
        d = pb.BookingDelta(kind=_KIND_TO_PB[ch.kind], id=ch.id, address=ch.address)
        pub = None
        if ch.kind == "book":
            d.prefill_blocks = ch.prefill_blocks
            d.decode_blocks = ch.decode_blocks
            if self.tracing is not None:  # a span only when the booking's request is sampled
                pub = self.tracing.publish("grpc")
        for link in self.links.values():
            link.offer(d, pub)
        if pub is not None:
            pub.attrs["epp.replica_sync.peers"] = pub.waiting  # the links that were up and took it
            pub.settle()

    def _forward_first_chunk(self, owner: str | None, booking_id: str) -> None:
        """Lean mode's first chunk of `owner`'s booking came to us: it goes on the link to that replica (to
        every link when the owner is not known yet: only the one that made the booking acts on it)."""
        links = [lk for lk in self.links.values() if owner is not None and lk.peer_id == owner] \
            or list(self.links.values())
        for link in links:
            link.offer(booking_id)
        if links:
            self.metrics.first_chunks.labels("forwarded").inc()

    def on_predict(self, address: str, block_size: int, hashes: Sequence[int], ttl_s: float) -> None:
        """A local prediction (a `WorkerFacts.predict_listeners` entry): the peers count it too."""
        if not self.links or not hashes:
            return
        p = pb.Prediction(address=address, block_size=block_size, hashes=hashes, ttl_ms=int(ttl_s * 1000))
        for link in self.links.values():
            link.offer(p)

    def offer_loads(self, loads: Sequence[pb.WorkerLoad]) -> None:
        """This replica's worker samples, for every peer's next batch (`MetricsShare`)."""
        for link in self.links.values():
            link.offer_loads(loads)

    def kick(self) -> None:
        """Send the queued samples now, on every link that has some."""
        for link in self.links.values():
            link.kick()

    # ------------------------------------------------------------------ peers

    def live_replicas(self) -> list[str]:
        """The peers whose stream from us is up: they get our samples (`MetricsShare`'s owners)."""
        return [lk.peer_id for lk in self.links.values() if lk.up and lk.peer_id is not None]

    def set_peers(self, targets: Iterable[str]) -> None:
        """The current peer set (gRPC targets: host:port or unix:path); links open and close to match."""
        want = set(targets)
        self._peers_known = True
        for t in list(self.links):
            if t not in want:
                link = self.links.pop(t)
                asyncio.get_running_loop().create_task(link.stop())
                log.info("replica sync: peer %s left the peer set", t)
        for t in sorted(want - set(self.links)):
            link = self.links[t] = PeerLink(self, t)
            link.start()

    def settled(self) -> bool:
        """Synced with every reachable peer: each link either failed (unreachable, we do not wait) or did its
        handshake and that peer's own snapshot reached us (or a peer timeout passed: it may not list us)."""
        if not self._peers_known:
            return False
        now = time.monotonic()
        for link in self.links.values():
            if not link.settled:
                return False
            if link.handshake_at is not None and link.peer_id is not None:
                inb = self.inbound.get(link.peer_id)
                if (inb is None or inb.snapshot_at is None) and now - link.handshake_at < self.peer_timeout_s:
                    return False
        return True

    # ------------------------------------------------------------------ server

    async def start(self, listen: Sequence[str]) -> None:
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]
        self._server = grpc.aio.server(options=opts)
        pb_grpc.add_ReplicaSyncServicer_to_server(self, self._server)
        self.addresses = []
        for addr in listen:
            if self.tls is not None and not addr.startswith("unix:"):
                port = self._server.add_secure_port(addr, self.tls.server_credentials())
            else:
                port = self._server.add_insecure_port(addr)
            self.addresses.append(addr if addr.startswith("unix:") else f"{addr.rpartition(':')[0]}:{port}")
        await self._server.start()
        log.info("replica sync %s listening on %s%s", self.replica_id, ", ".join(self.addresses),
                 " (mutual TLS over TCP)" if self.tls is not None else "")

    async def close(self, flush_s: float = 0.5) -> None:
        """Push what is still queued (the frees of a drain), then stop the links and the server."""
        await asyncio.gather(*(link.stop(flush_s) for link in self.links.values()))
        self.links.clear()
        if self._server is not None:
            await self._server.stop(0.2)
        for inb in self.inbound.values():
            if inb.expiry is not None:
                inb.expiry.cancel()

    async def Sync(self, request_iterator: AsyncIterator[pb.SyncRequest],  # noqa: N802 - gRPC method name
                   context: grpc.aio.ServicerContext) -> None:
        first = await self._read(context)
        if first is None or not first.HasField("hello") or not first.hello.replica_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a Hello")
            return
        peer = first.hello.replica_id
        await context.write(pb.SyncResponse(hello=pb.Hello(replica_id=self.replica_id,
                                                           incarnation=self.incarnation)))
        if peer == self.replica_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a replica does not sync with itself")
            return
        connected_ns = time.time_ns()
        inb = self.inbound.setdefault(peer, _Inbound())
        inb.generation += 1
        gen = inb.generation
        inb.connected = True
        last_ack = 0.0
        if inb.expiry is not None:
            inb.expiry.cancel()
            inb.expiry = None
        log.info("replica sync: peer %s connected (incarnation %x)", peer, first.hello.incarnation)
        gauge = self.metrics.peer_bookings.labels(peer)
        try:
            while True:
                msg = await self._read(context)
                if msg is None or inb.generation != gen:  # silent, closed, or superseded by a newer stream
                    log.debug("replica sync: stream from %s ends (%s)", peer,
                              "closed or silent" if msg is None else "superseded")
                    return
                if msg.HasField("snapshot"):
                    starting = self.tracing is not None and not self.settled()
                    self.load.peer_snapshot(peer, (HeldBooking(b.id, b.address, b.prefill_blocks,
                                                               b.decode_blocks, b.prefilling)
                                                   for b in msg.snapshot.bookings))
                    inb.snapshot_at = time.monotonic()
                    if self.tracing is not None:
                        self.tracing.snapshot_loaded("grpc", peer, len(msg.snapshot.bookings), connected_ns,
                                                     during_start=starting)
                elif msg.HasField("batch"):
                    self._apply(peer, msg.batch)
                    if msg.batch.oldest_change_unix > 0:
                        self.metrics.visible_lag.observe(max(time.time() - msg.batch.oldest_change_unix, 0.0))
                    now = time.monotonic()
                    heartbeat = not (msg.batch.deltas or msg.batch.predictions or msg.batch.first_chunks
                                     or msg.batch.loads)  # (a batch of samples alone is acked as changes are)
                    if heartbeat or now - last_ack >= ACK_INTERVAL_S:
                        last_ack = now
                        await context.write(pb.SyncResponse(ack=pb.Ack(seq=msg.batch.seq)))
                gauge.set(self.load.peer_inflight(peer))
        except Exception:
            log.exception("replica sync: stream from %s failed", peer)
            raise
        finally:
            if inb.generation == gen:
                inb.connected = False
                log.info("replica sync: peer %s went away; its %d bookings expire in %.1fs", peer,
                         self.load.peer_inflight(peer), self.expiry_s)
                inb.expiry = asyncio.get_running_loop().call_later(self.expiry_s, self._expire, peer, gen)

    async def _read(self, context: grpc.aio.ServicerContext) -> pb.SyncRequest | None:
        try:
            async with asyncio.timeout(self.peer_timeout_s):
                msg = await context.read()
        except TimeoutError:
            log.warning("replica sync: a peer stayed silent for %.1fs", self.peer_timeout_s)
            return None
        return None if msg is grpc.aio.EOF else msg

    def _apply(self, peer: str, batch: pb.Batch) -> None:
        apply_batch(self.load, self.registry, self.index, peer, batch, self.metrics, self.on_loads)

    def _expire(self, peer: str, gen: int) -> None:
        inb = self.inbound.get(peer)
        if inb is None or inb.generation != gen or inb.connected:
            return
        n = self.load.drop_peer(peer)
        del self.inbound[peer]
        self.metrics.peers_expired.inc()
        self.metrics.bookings_expired.inc(n)
        with contextlib.suppress(KeyError):
            self.metrics.peer_bookings.remove(peer)
        log.warning("replica sync: peer %s did not come back; dropped its %d bookings", peer, n)

    def snapshot(self) -> dict[str, object]:
        """For /debug: links, inbound peers, bookings held per peer."""
        return {"replica_id": self.replica_id, "settled": self.settled(),
                "links": {t: {"peer": lk.peer_id, "up": lk.up, "attempts": lk.attempts, "failures": lk.failures}
                          for t, lk in self.links.items()},
                "peers": {p: {"connected": i.connected, "bookings": self.load.peer_inflight(p)}
                          for p, i in self.inbound.items()}}


def apply_batch(load: LoadTracker, registry: EndpointRegistry, idx: PredictionSink | None, peer: str,
                batch: pb.Batch, metrics: SyncMetrics | None = None, on_loads: LoadsSink | None = None) -> None:
    """A peer's batch applied here, whichever plane brought it (this mesh, or NATS subjects)."""
    if batch.loads and on_loads is not None:
        on_loads(peer, batch.loads)
    change = load.peer_change
    for d in batch.deltas:
        kind = _PB_TO_KIND.get(d.kind)
        if kind is not None:
            change(peer, BookingChange(kind, d.id, d.address, d.prefill_blocks, d.decode_blocks))
    for booking_id in batch.first_chunks[:MAX_BATCH_ITEMS]:  # first chunks Envoy showed the peer: ours end here
        b = load.booking(booking_id)
        if b is not None:
            b.prefill_done()  # its PREFILL_DONE goes to every peer as any local change does
            if metrics is not None:
                metrics.first_chunks.labels("applied").inc()
    if idx is None:
        return
    for p in batch.predictions:
        # Only for workers we route to, in the block size we hash them with: anything else would create
        # index entries for unknown workers or predict hashes that can never match.
        if p.address in registry and idx.block_size(p.address) == p.block_size and p.ttl_ms > 0:
            idx.predict_hashes(p.address, p.hashes[:MAX_PREDICTION_HASHES],
                               min(p.ttl_ms / 1000, MAX_PREDICTION_TTL_S))


def _short(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"
