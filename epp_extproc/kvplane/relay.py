"""`epp-kv-relay`: reads the workers' own ZeroMQ KV events, keeps their index, publishes them on NATS and
answers dumps, so that a picker that starts or restarts recovers without any engine replay (issue 47).

Why the relay subscribes with kvindex's own :class:`~kvindex.subscriber.SubscriberManager`: the dialects, the
sequence gaps, the engine's replay and its restart rules are the picker's, tested there; the relay adds two
hooks (``_apply``, ``_clear``) and nothing else. Every batch it applied goes out, untouched, on the worker's
subject with the relay's own per-worker sequence (contiguous: a picker sees any loss on the plane as a gap) and
the relay's epoch (random per start: a picker sees a relay restart as a restart). Whatever made the relay
clear a rank (a gap the engine could not replay, a restart, an oversized batch) goes out as a clear.

A dump is the worker's slots (:mod:`kvindex.dump`) with the sequence it was taken at, in chunks that fit the
server's max payload. It is read in one synchronous step, so it is exactly the state after that sequence.

Bounded: the index by ``--max-index-blocks-per-worker``; the outbox by ``--outbox-messages`` and
``--outbox-bytes`` (past them, and while NATS is down after a first connect, messages are dropped and counted:
the sequence gap tells the pickers to ask for a dump); the client's own buffer by
:class:`~epp_extproc.kvplane.link.NatsLink`'s ``pending_bytes``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp_extproc.adapters.discovery_static import parse_flag, read_file
from epp_extproc.kvplane.link import NatsLink
from epp_extproc.kvplane.wire import (
    KIND_BATCH,
    KIND_CLEAR,
    DumpChunk,
    DumpSlot,
    Heartbeat,
    Subjects,
    encode_dump_chunk,
    encode_heartbeat,
    encode_live,
    parse_dump_request,
)
from kvindex.aio import cancel_and_wait
from kvindex.dump import export_slots, worker_block_size
from kvindex.index import KvIndex
from kvindex.subscriber import KvSource, SubscriberManager
from kvindex.subscription import Subscription

log = logging.getLogger(__name__)

CHUNK_OVERHEAD = 4096  # bytes of a dump chunk that are not hash arrays (map keys, worker id, slot headers)
PAIR_BYTES = 16


class RelaySubscribers(SubscriberManager):
    """The picker's subscriber, whose every applied batch and every clear is also handed to ``emit``."""

    def __init__(self, idx: KvIndex, emit: Any, **kwargs: Any) -> None:
        super().__init__(idx, **kwargs)
        self.emit = emit
        # per worker and rank, the engine's seq of the last batch applied: a dump says where its state stands
        # in the engine's numbering (`DumpChunk.engine_seqs`)
        self.engine_seqs: dict[str, dict[int | None, int]] = {}
        # per worker and rank, the engine's seq of the first batch applied since the rank was last empty (this
        # relay's start, or a clear): where the dump's history begins (`DumpChunk.first_seqs`), so a picker that
        # holds what an earlier relay told it can load this one's dump on top rather than in place
        self.first_seqs: dict[str, dict[int | None, int]] = {}

    def _apply(self, sub: Subscription, seq: int, payload: bytes) -> None:
        before = sub.stats.oversized
        super()._apply(sub, seq, payload)
        self.engine_seqs.setdefault(sub.worker_id, {})[sub.source.rank] = seq
        self.first_seqs.setdefault(sub.worker_id, {}).setdefault(sub.source.rank, seq)
        if sub.stats.oversized == before:  # an oversized batch was refused and cleared: `_clear` told them
            self.emit(KIND_BATCH, sub.worker_id, sub.source.rank, seq, payload)

    def _clear(self, sub: Subscription) -> None:
        super()._clear(sub)
        self.first_seqs.get(sub.worker_id, {}).pop(sub.source.rank, None)
        self.emit(KIND_CLEAR, sub.worker_id, sub.source.rank, sub.applied or 0, b"")

    async def remove(self, worker_id: str) -> None:
        self.engine_seqs.pop(worker_id, None)
        self.first_seqs.pop(worker_id, None)
        await super().remove(worker_id)


class Relay:
    """One relay: a set of workers (one, as a sidecar; a pool, as a deployment), one NATS link."""

    def __init__(self, servers: Sequence[str], subjects: Subjects, workers: dict[str, list[KvSource]], *,
                 publish_live: bool = True, name: str | None = None, topic: str = "",
                 block_size: int = 32, max_blocks_per_worker: int = 1_000_000, heartbeat_s: float = 1.0,
                 outbox_messages: int = 100_000, outbox_bytes: int = 64 * 1024 * 1024,
                 registry: CollectorRegistry | None = None,
                 epoch: int | None = None) -> None:
        self.subjects = subjects
        self.workers = workers
        self.publish_live = publish_live
        self.name = name or f"relay-{socket.gethostname()}-{os.getpid()}"
        # a new epoch per start: pickers take a change as the relay's restart (its index was rebuilt)
        self.epoch = epoch if epoch is not None else random.getrandbits(63)
        self.heartbeat_s = heartbeat_s
        self.idx = KvIndex(block_size, max_blocks_per_worker)
        self.subs = RelaySubscribers(self.idx, self._emit, topic=topic)
        self.link = NatsLink(servers, self.name, on_up=self._on_up, on_down=lambda: None)
        self.seq: dict[str, int] = {}
        self._subjects = {w: subjects.events(w) for w in workers}
        self._outbox: deque[tuple[str, bytes]] = deque()
        self.outbox_messages = outbox_messages
        self.outbox_bytes = outbox_bytes  # a batch may be 16 MiB: the count alone would not bound the memory
        self.queued_bytes = 0
        self._outbox_ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._dump_subs: list[Any] = []
        self.published = 0
        self.dropped = 0  # messages not published (outbox full, NATS down): subscribers see a gap
        self.dumps_served = 0
        self.dump_requests_refused = 0
        self.started = time.monotonic()
        if registry is not None:
            registry.register(_RelayCollector(self))

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        for wid, sources in self.workers.items():
            self.seq[wid] = 0
            await self.subs.add(wid, sources)
        self.link.start()
        self._tasks = [asyncio.create_task(self._publisher(), name="relay-publisher"),
                       asyncio.create_task(self._heartbeats(), name="relay-heartbeats")]
        log.info("relay %s (epoch %d): %d workers, live plane %s", self.name, self.epoch, len(self.workers),
                 "on" if self.publish_live else "off")

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        await self._goodbye()
        await self.subs.close()
        await self.link.close()

    async def _goodbye(self) -> None:
        """A last heartbeat saying this relay stops: the pickers then take the next relay's stream for these
        workers as its restart at once, rather than as a second relay beside a live one (`PlaneSubscribers`
        ignores those while the relay it follows is heard). A relay that crashes sends none: its silence past
        the pickers' ``relay_stale_s`` says the same."""
        nc = self.link.nc
        if nc is None or not nc.is_connected or not self.publish_live:
            return
        with contextlib.suppress(Exception):
            await nc.publish(self.subjects.heartbeat,
                             encode_heartbeat(Heartbeat(self.name, self.epoch, dict(self.seq), bye=True)))
            await nc.flush(timeout=1)

    async def _on_up(self) -> None:
        """Connected (first time or again): serve the dumps (the client re-subscribes on reconnects itself)."""
        nc = self.link.nc
        self._outbox_ready.set()  # what was emitted before the first connect goes out now
        if nc is None or self._dump_subs:
            return
        for wid in self.workers:
            self._dump_subs.append(await nc.subscribe(self.subjects.dump(wid), cb=self._on_dump_request))

    # ------------------------------------------------------------- live plane
    def _emit(self, kind: int, worker_id: str, rank: int | None, engine_seq: int, payload: bytes) -> None:
        """Called synchronously right after the index changed: the sequence is taken here, so a dump read in
        one synchronous step is exactly the state at its sequence."""
        seq = self.seq.get(worker_id, 0) + 1
        self.seq[worker_id] = seq
        if not self.publish_live:
            return
        # Before the first connect the outbox keeps them (bounded): a restarted relay's stream then reaches
        # the pickers from its first message, which lets them carry what they hold across the restart instead
        # of replacing it with this relay's partial index (`PlaneSubscribers`). Once the link was up, a message
        # that cannot go now is dropped: its sequence gap sends the pickers to a dump.
        if (len(self._outbox) >= self.outbox_messages or self.queued_bytes + len(payload) > self.outbox_bytes
                or (self.link.connects and not self.link.connected)):
            self.dropped += 1
            return
        self._enqueue(self._subjects[worker_id], encode_live(kind, rank, self.epoch, seq, engine_seq, worker_id,
                                                             payload))

    def _enqueue(self, subject: str, data: bytes) -> None:
        self._outbox.append((subject, data))
        self.queued_bytes += len(data)
        self._outbox_ready.set()

    async def _publisher(self) -> None:
        box = self._outbox
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            nc = self.link.nc
            if nc is None:
                continue  # not connected yet: `_on_up` wakes this once it is
            while box:
                subject, data = box.popleft()
                self.queued_bytes -= len(data)
                if not nc.is_connected:
                    self.dropped += 1 + len(box)
                    box.clear()
                    self.queued_bytes = 0
                    break
                try:
                    await nc.publish(subject, data)
                    self.published += 1
                except Exception as exc:  # buffer full while reconnecting, payload over the server's max
                    self.dropped += 1
                    log.debug("relay publish on %s failed: %s", subject, exc)

    async def _heartbeats(self) -> None:
        """Which workers this relay serves and the last sequence of each, through the same outbox as the
        batches (one connection keeps their order): a picker behind on a worker learns it lost the tail."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self.link.connected or len(self._outbox) >= self.outbox_messages:
                continue  # (a full outbox: the batches' own sequence shows the loss; the next heartbeat comes)
            self._enqueue(self.subjects.heartbeat, encode_heartbeat(Heartbeat(self.name, self.epoch, dict(self.seq))))

    # ------------------------------------------------------------------ dumps
    async def _on_dump_request(self, msg: Any) -> None:
        wid = parse_dump_request(msg.data)
        nc = self.link.nc
        if wid is None or wid not in self.workers or not msg.reply or nc is None:
            self.dump_requests_refused += 1
            return
        for chunk in self.dump(wid, nc.max_payload):
            await nc.publish(msg.reply, chunk)
        self.dumps_served += 1

    def dump(self, worker_id: str, max_payload: int) -> list[bytes]:
        """The worker's dump as encoded chunks, read in one synchronous step (no await: nothing is applied
        meanwhile), so its sequence is exactly the last change it contains."""
        per_chunk = max(1, (max_payload - CHUNK_OVERHEAD) // PAIR_BYTES)
        seq = self.seq.get(worker_id, 0)
        bs, src, dialect = worker_block_size(self.idx, worker_id)
        pieces = list(export_slots(self.idx, worker_id, per_chunk))
        chunks: list[list[DumpSlot]] = [[]]
        room = per_chunk
        for rank, size, eng, ours in pieces:
            if len(eng) > room:
                chunks.append([])
                room = per_chunk
            chunks[-1].append(DumpSlot(rank, size, eng.tobytes(), ours.tobytes()))
            room -= len(eng)
        n = len(chunks)
        engine_seqs = dict(self.subs.engine_seqs.get(worker_id, {}))
        first_seqs = dict(self.subs.first_seqs.get(worker_id, {}))
        return [encode_dump_chunk(DumpChunk(worker_id, self.epoch, seq, i, n, bs, src, slots, dialect, engine_seqs,
                                            first_seqs))
                for i, slots in enumerate(chunks)]

    def stats(self) -> dict[str, Any]:
        return {"relay": self.name, "epoch": self.epoch, "connected": self.link.connected,
                "published": self.published, "dropped": self.dropped, "queued_bytes": self.queued_bytes,
                "dumps_served": self.dumps_served,
                "dump_requests_refused": self.dump_requests_refused, "nats_connects": self.link.connects,
                "nats_disconnects": self.link.disconnects,
                "workers": {w: {"seq": self.seq.get(w, 0), "blocks": self.idx.blocks_indexed(w)}
                            for w in self.workers},
                "subscribers": self.subs.stats_snapshot()}


class _RelayCollector(Collector):
    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def collect(self) -> list[Metric]:
        r = self.relay
        out: list[Metric] = []
        for name, value, text in (
                ("published", r.published, "Messages published on the plane"),
                ("dropped", r.dropped, "Messages not published (outbox full or NATS down): pickers see a gap"),
                ("dumps_served", r.dumps_served, "Dumps answered"),
                ("nats_connects", r.link.connects, "NATS connects and reconnects")):
            m = CounterMetricFamily(f"epp_kv_relay_{name}", text)
            m.add_metric([], value)
            out.append(m)
        g = GaugeMetricFamily("epp_kv_relay_connected", "1 while the relay's NATS link is up")
        g.add_metric([], 1 if r.link.connected else 0)
        out.append(g)
        restarts = CounterMetricFamily("epp_kv_relay_publisher_restarts",
                                       "Engine restarts the relay saw (its index rebuilt from replay or new events)",
                                       labels=["worker"])
        for w, d in r.subs.stats_snapshot().items():
            restarts.add_metric([w], d["restarts"])
        out.append(restarts)
        return out


# ---------------------------------------------------------------------------------------------- the CLI
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="epp-kv-relay",
        description="Subscribe to workers' ZeroMQ KV events, keep their index, publish them on NATS and "
                    "answer dumps (issue 47; docs/kv-event-plane.md).")
    p.add_argument("--nats-url", default=os.environ.get("DYN_EPP_NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS server(s), comma-separated")
    p.add_argument("--pool", default=os.environ.get("DYN_EPP_KV_PLANE_POOL", "default"),
                   help="the pool's subject token: pickers of the same pool use the same")
    p.add_argument("--subject-prefix", default="epp.kv")
    p.add_argument("--endpoints", default=None,
                   help="workers, in the picker's --endpoints syntax (their addresses are their identities)")
    p.add_argument("--endpoints-file", default=None, help="workers, in the picker's --endpoints-file format")
    p.add_argument("--kv-event-plane", choices=("nats", "zmq"), default="nats",
                   help="nats: publish each worker's batches on NATS; zmq: only keep the index and answer dumps")
    p.add_argument("--kv-event-topic", default="")
    p.add_argument("--kv-cache-block-size", type=int, default=32)
    p.add_argument("--max-index-blocks-per-worker", type=int, default=1_000_000)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--outbox-messages", type=int, default=100_000,
                   help="messages queued for NATS at most (past it they are dropped and counted: pickers see a gap)")
    p.add_argument("--outbox-bytes", type=int, default=64 * 1024 * 1024,
                   help="bytes of batches queued for NATS at most (before the first connect, and a burst)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = none)")
    p.add_argument("--name", default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not args.endpoints and not args.endpoints_file:
        p.error("name the workers: --endpoints or --endpoints-file")
    return args


def workers_of(args: argparse.Namespace) -> dict[str, list[KvSource]]:
    eps = (parse_flag(args.endpoints, kv_event_port=None, replay_port=None) if args.endpoints
           else read_file(args.endpoints_file, kv_event_port=None, replay_port=None))
    out: dict[str, list[KvSource]] = {}
    for ep in eps:
        if not ep.kv_endpoints:
            raise SystemExit(f"endpoint {ep.address} has no kv= endpoint: nothing to relay")
        out[ep.address] = [KvSource(pub, replay, rank) for rank, pub, replay in ep.kv_endpoints]
    return out


async def run(args: argparse.Namespace) -> None:
    registry = CollectorRegistry() if args.metrics_port else None
    relay = Relay([u.strip() for u in args.nats_url.split(",") if u.strip()],
                  Subjects(args.subject_prefix, args.pool), workers_of(args),
                  publish_live=args.kv_event_plane == "nats", name=args.name, topic=args.kv_event_topic,
                  block_size=args.kv_cache_block_size, max_blocks_per_worker=args.max_index_blocks_per_worker,
                  heartbeat_s=args.heartbeat_s, outbox_messages=args.outbox_messages, outbox_bytes=args.outbox_bytes,
                  registry=registry)
    if registry is not None:
        start_http_server(args.metrics_port, registry=registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await relay.start()
    try:
        await stop.wait()
    finally:
        await relay.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
