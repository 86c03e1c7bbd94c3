"""The work a decision waits on, and the sync work it causes, as spans: an ingest shard's answer under
`--kv-ingest apart`, a booking's publish to the peer replicas (gRPC mesh and NATS), and the start-up loads
(a peer's snapshot, a relay's dump) as root spans of their own. Spans kept in memory by the SDK's own
in-memory exporter, as tests/unit/test_tracing.py does."""

from __future__ import annotations

import socket
import tempfile
import threading
from array import array
from collections.abc import Iterator
from typing import Any

import opentelemetry.sdk.trace as sdk_trace
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from epp_extproc.adapters.kv_remote import RemoteKv
from epp_extproc.core.contract import PromptIdentity
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.ingest import wire
from epp_extproc.tracing import spans
from epp_extproc.tracing.spans import ExchangeSpan, SpanQueue, Tracing

ROWS = [("w:1", 4, True, None), ("v:2", 4, True, None)]
META = wire.encode_meta(ROWS, [4])


def memory_tracing(sampler: Any = None) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    queue = SpanQueue(exporter, Resource.create({"service.name": "test"}), immediate=True)
    return Tracing(queue, sampler or ParentBased(ALWAYS_ON)), exporter


@pytest.fixture
def span_count(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every SDK span object the process makes."""
    made = [0]
    original = sdk_trace.ReadableSpan.__init__

    def counting(self: Any, *a: Any, **kw: Any) -> None:
        made[0] += 1
        original(self, *a, **kw)

    monkeypatch.setattr(sdk_trace.ReadableSpan, "__init__", counting)
    yield made


def by_name(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {s.name: s for s in exporter.get_finished_spans()}


def request_span(tr: Tracing) -> ExchangeSpan:
    return ExchangeSpan(tr, 0x4bf92f3577b34da6a3ce929d0e0e4736, None, False, None, "/v1/chat/completions")


# ------------------------------------------------------------------------------------------ ingest apart
def shard(path: str, done: threading.Event, answer: bool = True, service_s: float = 0.0004,
          lag_s: float = 0.012) -> threading.Thread:
    """One connection; each request answered (w:1 holds 2 blocks, v:2 one) with these figures, or read and
    left unanswered (a shard stuck behind its ingest)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        conn.settimeout(0.05)
        while not done.is_set():
            try:
                buf = conn.recv(1 << 20)
            except TimeoutError:
                continue
            if not buf:
                break
            req = wire.unpack_lookup(buf)
            if answer:
                conn.send(wire.pack_answer(req.req_id, 7, META, array("I", [2, 1]), service_s, lag_s))
        conn.close()
        srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def remote(directory: str, timeout_s: float = 2.0) -> RemoteKv:
    return RemoteKv(EndpointRegistry(), directory=directory, shards=1, block_size=4, prediction_ttl_s=0.0,
                    lookup_timeout_s=timeout_s, ask_server_info=False)


def test_a_shards_answer_is_a_child_of_the_lookup_with_its_service_time_queue_and_batch_lag() -> None:
    tr, exporter = memory_tracing()
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        t = shard(wire.lookup_socket(d, 0), done)
        kv = tr.kv(remote(d))
        rec = request_span(tr)
        token = rec.attach()
        try:
            assert kv.overlap(kv.prompt(list(range(12)), PromptIdentity()), ["w:1", "v:2"]) == {"w:1": 2, "v:2": 1}
        finally:
            rec.detach(token)
        rec.end()
        done.set()
        t.join(5)
    got = by_name(exporter)
    lookup, answer = got[spans.KV_LOOKUP_SPAN], got[spans.INGEST_LOOKUP_SPAN]
    assert answer.parent.span_id == lookup.context.span_id
    assert answer.kind is SpanKind.CLIENT and answer.status.status_code is StatusCode.UNSET
    a = answer.attributes
    assert a["epp.kv.ingest.shard"] == 0 and a["epp.kv.ingest.result"] == "ok"
    assert a["network.transport"] == "unix"
    assert a["epp.kv.ingest.service_s"] == pytest.approx(0.0004, rel=1e-3)  # the shard's figure, as f32
    assert a["epp.kv.ingest.batch_lag_s"] == pytest.approx(0.012, rel=1e-3)
    waited = (answer.end_time - answer.start_time) / 1e9
    assert 0 <= a["epp.kv.ingest.queued_s"] <= waited
    assert "epp.kv.ingest.unanswered_shards" not in lookup.attributes


def test_a_shard_that_does_not_answer_in_time_is_an_error_span_saying_its_candidates_went_by_load() -> None:
    tr, exporter = memory_tracing()
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        t = shard(wire.lookup_socket(d, 0), done, answer=False)
        kv = tr.kv(remote(d, timeout_s=0.02))
        rec = request_span(tr)
        token = rec.attach()
        try:
            assert kv.overlap(kv.prompt(list(range(12)), PromptIdentity()), ["w:1", "v:2"]) == {}
        finally:
            rec.detach(token)
        rec.end()
        done.set()
        t.join(5)
    got = by_name(exporter)
    answer = got[spans.INGEST_LOOKUP_SPAN]
    assert answer.status.status_code is StatusCode.ERROR
    assert "by load" in (answer.status.description or "")
    assert answer.attributes["error.type"] == "timeout"
    assert "epp.kv.ingest.service_s" not in answer.attributes
    assert got[spans.KV_LOOKUP_SPAN].attributes["epp.kv.ingest.unanswered_shards"] == 1


def test_a_shard_that_is_down_is_an_unavailable_span_at_once() -> None:
    tr, exporter = memory_tracing()
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        kv = tr.kv(remote(d))  # nothing listens
        rec = request_span(tr)
        token = rec.attach()
        try:
            assert kv.overlap(kv.prompt(list(range(12)), PromptIdentity()), ["w:1"]) == {}
        finally:
            rec.detach(token)
        rec.end()
    answer = by_name(exporter)[spans.INGEST_LOOKUP_SPAN]
    assert answer.attributes["error.type"] == "unavailable"
    assert answer.status.status_code is StatusCode.ERROR


def test_a_large_pools_lookup_by_array_is_a_lookup_span_with_the_shards_answer_under_it() -> None:
    tr, exporter = memory_tracing()
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        t = shard(wire.lookup_socket(d, 0), done)
        kv = tr.kv(remote(d))
        rec = request_span(tr)
        token = rec.attach()
        try:
            got = kv.overlap_array(kv.prompt(list(range(12)), PromptIdentity()), ("v:2", "w:1"))
        finally:
            rec.detach(token)
        rec.end()
        done.set()
        t.join(5)
    assert list(got) == [1, 2]
    s = by_name(exporter)
    assert s[spans.KV_LOOKUP_SPAN].attributes["epp.kv.best_overlap_blocks"] == 2
    assert s[spans.INGEST_LOOKUP_SPAN].parent.span_id == s[spans.KV_LOOKUP_SPAN].context.span_id


def test_without_tracing_the_remote_lookup_has_no_observer_and_makes_no_span(span_count: list[int]) -> None:
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        t = shard(wire.lookup_socket(d, 0), done)
        kv = remote(d)
        assert kv.lookup_observer is None
        assert kv.overlap(kv.prompt(list(range(12)), PromptIdentity()), ["w:1", "v:2"]) == {"w:1": 2, "v:2": 1}
        done.set()
        t.join(5)
    assert span_count[0] == 0


def test_an_unsampled_request_makes_no_ingest_span(span_count: list[int]) -> None:
    tr, exporter = memory_tracing()
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        t = shard(wire.lookup_socket(d, 0), done)
        kv = tr.kv(remote(d))
        assert kv.overlap(kv.prompt(list(range(12)), PromptIdentity()), ["w:1", "v:2"]) == {"w:1": 2, "v:2": 1}
        done.set()
        t.join(5)
    assert span_count[0] == 0 and not exporter.get_finished_spans()


def test_a_real_shards_answer_carries_its_service_time_and_no_lag_before_any_batch() -> None:
    from epp_extproc.ingest.server import IngestShard

    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        s = IngestShard(d)
        try:
            buf = s.answer(wire.pack_lookup(9, 0, True, [(32, [1, 2, 3])]))
        finally:
            s._zmq.destroy(linger=0)
    assert wire.unpack_answer(buf)[0] == 9
    service_s, lag_s = wire.answer_figures(buf)
    assert 0 < service_s < 1 and lag_s is None


# ------------------------------------------------------------------------------------------ replica sync
WORKER = "127.0.0.1:1"


async def until(cond: Any, what: str, timeout_s: float = 5.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def booked_in_sampled_request(tr: Tracing, load: Any) -> tuple[ExchangeSpan, int]:
    """A sampled request's decision and commit, as the Director makes them under the exchange's span."""
    rec = request_span(tr)
    token = rec.attach()
    try:
        rec.decision = decision = 0x1234
        load.book(WORKER, 10)
    finally:
        rec.detach(token)
    return rec, decision


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def test_a_sampled_bookings_publish_over_the_grpc_mesh_is_a_child_of_its_decision_and_the_peer_loads_a_snapshot(
        ) -> None:
    from epp_extproc.adapters.replica_sync import ReplicaSync
    from epp_extproc.core.load import LoadTracker

    tr_a, exp_a = memory_tracing()
    tr_b, exp_b = memory_tracing()
    reg = EndpointRegistry()
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        a = ReplicaSync(LoadTracker(), reg, replica_id="a", tracing=tr_a)
        b = ReplicaSync(LoadTracker(), reg, replica_id="b", tracing=tr_b)
        await b.start([f"unix:{d}/b.sock"])
        try:
            a.set_peers([f"unix:{d}/b.sock"])
            await until(lambda: a.links[f"unix:{d}/b.sock"].up, "the link up")
            await until(lambda: spans_named(exp_b, spans.SYNC_SNAPSHOT_SPAN), "B's snapshot span")
            rec, decision = booked_in_sampled_request(tr_a, a.load)
            await until(lambda: spans_named(exp_a, spans.SYNC_PUBLISH_SPAN), "A's publish span")
            await until(lambda: b.load.load(WORKER).prefill_blocks == 10, "the booking at B")
        finally:
            await a.close(0)
            await b.close(0)
    pub, = spans_named(exp_a, spans.SYNC_PUBLISH_SPAN)
    assert pub.context.trace_id == rec.trace_id and pub.parent.span_id == decision
    assert pub.kind is SpanKind.PRODUCER and pub.status.status_code is StatusCode.UNSET
    assert {k: pub.attributes[k] for k in ("rpc.system", "rpc.service", "rpc.method", "epp.replica_sync.plane",
                                           "epp.replica_sync.peers", "epp.replica_sync.via")} == {
        "rpc.system": "grpc", "rpc.service": "epp.v1.ReplicaSync", "rpc.method": "Sync",
        "epp.replica_sync.plane": "grpc", "epp.replica_sync.peers": 1, "epp.replica_sync.via": "batch"}
    snap = spans_named(exp_b, spans.SYNC_SNAPSHOT_SPAN)[0]
    assert snap.parent is None  # a root of its own: no request asked for it
    assert snap.attributes["epp.replica_sync.peer"] == "a" and snap.attributes["epp.replica_sync.bookings"] == 0
    assert snap.attributes["epp.replica_sync.during_start"] is True
    assert snap.kind is SpanKind.CONSUMER


async def test_a_booking_with_no_peer_link_up_is_a_publish_span_to_nobody() -> None:
    from epp_extproc.adapters.replica_sync import ReplicaSync
    from epp_extproc.core.load import LoadTracker

    tr, exporter = memory_tracing()
    a = ReplicaSync(LoadTracker(), EndpointRegistry(), replica_id="a", tracing=tr)
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        a.set_peers([f"unix:{d}/nobody.sock"])
        booked_in_sampled_request(tr, a.load)
        await a.close(0)
    pub, = spans_named(exporter, spans.SYNC_PUBLISH_SPAN)
    assert pub.attributes["epp.replica_sync.peers"] == 0 and pub.attributes["epp.replica_sync.via"] == "none"


class FakeNc:
    is_connected = True

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        self.published.append((subject, data))


async def test_a_sampled_bookings_nats_publish_follows_the_messaging_conventions_and_a_peers_snapshot_is_a_root()\
        -> None:
    import asyncio

    from epp_extproc.adapters.replica_sync_nats import NatsReplicaSync, encode
    from epp_extproc.core.load import LoadTracker
    from epp_extproc.proto_gen.epp.v1 import replica_sync_pb2 as pb

    tr, exporter = memory_tracing()
    s = NatsReplicaSync(LoadTracker(), EndpointRegistry(), servers=["nats://127.0.0.1:1"], pool="p", replica_id="a",
                        tracing=tr)
    nc = FakeNc()
    s.link.nc = nc  # type: ignore[assignment]
    s._need_snapshot = False
    snap = pb.SyncRequest(snapshot=pb.Snapshot(bookings=[pb.Booking(id="x", address=WORKER, prefill_blocks=3)]))
    s._on_data("epp.sync.p.r.b", encode("b", 7, 0, snap))
    sender = asyncio.create_task(s._sender())
    try:
        rec, decision = booked_in_sampled_request(tr, s.load)
        name = f"publish {s.subject}"
        await until(lambda: spans_named(exporter, name), "the publish span")
    finally:
        sender.cancel()
    pub, = spans_named(exporter, name)
    assert pub.parent.span_id == decision and pub.context.trace_id == rec.trace_id
    assert pub.kind is SpanKind.PRODUCER
    assert {k: pub.attributes[k] for k in ("messaging.system", "messaging.destination.name",
                                           "messaging.operation.type", "epp.replica_sync.peers",
                                           "epp.replica_sync.via", "epp.replica_sync.batch_items")} == {
        "messaging.system": "nats", "messaging.destination.name": s.subject, "messaging.operation.type": "send",
        "epp.replica_sync.peers": 1, "epp.replica_sync.via": "batch", "epp.replica_sync.batch_items": 1}
    loaded, = spans_named(exporter, spans.SYNC_SNAPSHOT_SPAN)
    assert loaded.parent is None and loaded.attributes["epp.replica_sync.peer"] == "b"
    assert loaded.attributes["messaging.destination.name"] == "epp.sync.p.r.b"
    assert loaded.attributes["epp.replica_sync.bookings"] == 1


async def test_with_tracing_off_the_sync_planes_make_no_span(span_count: list[int]) -> None:
    import asyncio

    from epp_extproc.adapters.replica_sync_nats import NatsReplicaSync, encode
    from epp_extproc.core.load import LoadTracker
    from epp_extproc.proto_gen.epp.v1 import replica_sync_pb2 as pb

    s = NatsReplicaSync(LoadTracker(), EndpointRegistry(), servers=["nats://127.0.0.1:1"], pool="p", replica_id="a")
    nc = FakeNc()
    s.link.nc = nc  # type: ignore[assignment]
    s._need_snapshot = False
    s._on_data("epp.sync.p.r.b", encode("b", 7, 0, pb.SyncRequest(snapshot=pb.Snapshot())))
    sender = asyncio.create_task(s._sender())
    try:
        s.load.book(WORKER, 10)
        await until(lambda: nc.published, "the batch")
    finally:
        sender.cancel()
    assert s._traced == [] and span_count[0] == 0


async def test_an_unsampled_requests_booking_makes_no_publish_span(span_count: list[int]) -> None:
    from epp_extproc.adapters.replica_sync_nats import NatsReplicaSync
    from epp_extproc.core.load import LoadTracker

    tr, exporter = memory_tracing()
    s = NatsReplicaSync(LoadTracker(), EndpointRegistry(), servers=["nats://127.0.0.1:1"], pool="p", replica_id="a",
                        tracing=tr)
    s.load.book(WORKER, 10)  # no request is current: not sampled
    assert s._traced == [] and span_count[0] == 0


def test_a_start_up_load_is_sampled_by_the_roots_ratio() -> None:
    import time

    tr, exporter = memory_tracing(ParentBased(TraceIdRatioBased(0.0)))
    tr.snapshot_loaded("grpc", "b", 3, time.time_ns(), during_start=True)
    assert not exporter.get_finished_spans()
    tr, exporter = memory_tracing(ParentBased(TraceIdRatioBased(1.0)))
    tr.dump_loaded("w:1", time.time_ns(), error=("timeout", "no dump within 3 s"))
    got, = exporter.get_finished_spans()
    assert got.name == spans.PLANE_DUMP_SPAN and got.parent is None and got.status.status_code is StatusCode.ERROR


def test_a_dump_loaded_on_top_of_the_workers_entries_says_so() -> None:
    import time

    tr, exporter = memory_tracing(ParentBased(TraceIdRatioBased(1.0)))
    tr.dump_loaded("w:1", time.time_ns(), blocks=3, chunks=1, merged=True)
    tr.dump_loaded("w:1", time.time_ns(), blocks=3, chunks=1)
    merged, replaced = exporter.get_finished_spans()
    assert merged.attributes["epp.kv_plane.dump_merged"] is True
    assert replaced.attributes["epp.kv_plane.dump_merged"] is False
