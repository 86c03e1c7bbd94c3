"""The picker's sampled requests written as OTLP bytes (`otlp_wire`) are what the SDK's encoder would write, and
the SDK's own OTLP exporters (HTTP and gRPC) send them to a real receiver of the protocol's protobuf."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http import trace_exporter as http_module
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

from epp_extproc.core.errors import PickError, Problem
from epp_extproc.tracing import otlp_wire
from epp_extproc.tracing.spans import Record, SpanQueue, Tracing
from tests.otlp_receiver import http_bodies
from tests.unit.test_tracing import SAMPLED, request, run, servicer

RESOURCE = Resource.create({"service.name": "epp-test", "k8s.pod.name": "picker-0", "replicas": 3})


class Keep(SpanQueue):
    """The queue's records, kept instead of exported."""

    def __init__(self, resource: Resource = RESOURCE) -> None:
        super().__init__(InMemorySpanExporter(), resource, immediate=True)
        self.records: list[Any] = []

    def put(self, record: Any) -> None:
        self.records.append(record)


async def picker_records() -> Keep:
    """Records the real edge and Director make: sampled by the gateway (with a tracestate), by a client's
    header, by the picker itself, a refused request, and two spans of their own (a snapshot, a failed dump)."""
    keep = Keep()
    tr = Tracing(keep, ParentBased(ALWAYS_ON))
    svc = servicer(tr)
    await run(svc, request(), (("traceparent", SAMPLED), ("tracestate", "vendor=abc,other=1")))
    await run(svc, request({"traceparent": SAMPLED}))
    await run(svc, request())
    await run(svc, request(body=b"{not json"))
    tr.snapshot_loaded("grpc", "10.0.0.9:9000", 12, 1_000, during_start=True)
    tr.dump_loaded("10.0.0.1:8000", 2_000, subject="kv.w1", error=("timeout", "no answer in 2 s"))
    return keep


def wire(keep: Keep, records: list[Any]) -> bytes:
    return keep._encoded(records).payload


def sdk(keep: Keep, records: list[Any]) -> bytes:
    return sdk_encode_spans(keep._spans(records)).SerializeToString()


async def test_the_wire_bytes_equal_the_sdk_encoding_of_the_pickers_own_requests() -> None:
    keep = await picker_records()
    assert len(keep.records) == 6
    assert any(r[7] is not None for r in keep.records if not isinstance(r[0], str))  # the refused one
    assert wire(keep, keep.records) == sdk(keep, keep.records)


def test_attribute_values_of_every_kind_are_encoded_as_the_sdk_encodes_them() -> None:
    keep = Keep()
    attrs = {"s": "é ü", "empty": "", "t": True, "f": False, "zero": 0, "neg": -7, "big": 2**62, "min": -2**63,
             "x": 1.5, "nan": float("nan"), "inf": float("-inf"), "names": ("a", "b"), "counts": [1, 2],
             "raw": b"\x00\xff", "long": "v" * 300}
    record: Record = (0xABC, "", 0x1234, 0, 10, 20, attrs, "", ())
    assert wire(keep, [record]) == sdk(keep, [record])


def test_a_tracestate_is_written_as_the_sdk_parses_it_dropping_invalid_members() -> None:
    keep = Keep()
    record: Record = (0xABC, "good=1,Bad Key=x,also=2", 0x1234, 0x99, 10, 20, {}, None, ())
    assert wire(keep, [record]) == sdk(keep, [record])


def test_a_stage_whose_parent_is_not_in_the_record_has_no_parent_as_the_sdk_path_gives_it() -> None:
    keep = Keep()
    children = (("epp.schedule", 0, 0x51, 0x777, 11, 12, {"epp.cost": 1.0}, None),)
    record: Record = (0xABC, "", 0x1234, 0, 10, 20, {}, None, children)
    assert wire(keep, [record]) == sdk(keep, [record])


def test_the_patched_module_hands_anything_but_an_encoded_batch_to_the_sdk(monkeypatch: Any) -> None:
    monkeypatch.setattr(http_module, "encode_spans", http_module.encode_spans)  # undone after the test
    assert otlp_wire.install(HttpExporter(endpoint="http://127.0.0.1:9/v1/traces"))
    keep = Keep()
    record: Record = (0xABC, "", 0x1234, 0, 10, 20, {"a": 1}, None, ())
    spans = keep._spans([record])
    assert http_module.encode_spans(spans) == sdk_encode_spans(spans)


def test_an_exporter_that_is_not_the_sdks_otlp_one_is_left_alone() -> None:
    assert not otlp_wire.install(InMemorySpanExporter())


def test_the_sdks_http_exporter_posts_the_encoded_bytes_to_a_real_receiver(monkeypatch: Any) -> None:
    monkeypatch.setattr(http_module, "encode_spans", http_module.encode_spans)
    with http_bodies() as (port, bodies):
        exporter = HttpExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces")
        assert otlp_wire.install(exporter)
        keep = Keep()
        batch = keep._encoded([(0xABC, "", 0x1234, 0, 10, 20, {"a": "b"}, None, ())])
        assert exporter.export(batch) is SpanExportResult.SUCCESS
        exporter.shutdown()
    assert bodies == [("/v1/traces", batch.payload)]


def test_the_sdks_grpc_exporter_sends_the_encoded_request_to_a_real_receiver() -> None:
    got: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, req: Any, context: Any) -> Any:  # noqa: N802
            got.append(req)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        exporter = GrpcExporter(endpoint=f"127.0.0.1:{port}", insecure=True)
        assert otlp_wire.install(exporter)
        keep = Keep()
        err = PickError(Problem.BAD_REQUEST, "no")
        batch = keep._encoded([(0xABC, "k=v", 0x1234, 0x77, 10, 20, {"error.type": err.problem.value}, "no", ())])
        assert exporter.export(batch) is SpanExportResult.SUCCESS
        exporter.shutdown()
    finally:
        server.stop(0)
    assert [r.SerializeToString() for r in got] == [batch.payload]


def test_the_encoded_pairs_kept_for_reuse_are_bounded_and_pairs_past_the_bound_still_encode_right() -> None:
    keep = Keep()
    records: list[Any] = [(0xABC, "", 0x1000 + i, 0, 10, 20, {"epp.endpoint": f"10.0.{i // 250}.{i % 250}:8000"},
                           None, ()) for i in range(otlp_wire._MAX_PAIRS + 500)]
    assert wire(keep, records) == sdk(keep, records)
    assert len(otlp_wire._PAIRS) <= otlp_wire._MAX_PAIRS
    assert len(otlp_wire._KEYS) <= otlp_wire._MAX_KEYS


def test_the_resource_and_scope_encoded_once_are_what_the_sdk_writes_with_or_without_a_schema_url() -> None:
    """The queue encodes the request's resource and scope once (`otlp_wire.envelope`), at its start: every batch
    still equals the SDK's encoding, a resource with a schema URL too, and a batch of spans over 127 bytes."""
    for schema in ("", "https://opentelemetry.io/schemas/1.21.0"):
        keep = Keep(Resource.create({"service.name": "epp", "n": 3}, schema_url=schema or None))
        records: list[Any] = [(0xABC, "", 0x1234, 0, 10, 20, {"long": "v" * 200}, None, ()),
                              (0xABE, "", 0x1236, 0, 10, 20, {"longer": "w" * 20_000}, None, ()),  # 3-byte lengths
                              (0xABD, "", 0x1235, 0, 10, 20, {}, None, ())]
        assert wire(keep, records) == sdk(keep, records)
        assert wire(keep, records[1:]) == sdk(keep, records[1:])


def test_numbers_and_bools_are_encoded_once_per_key_and_type_and_equal_values_of_other_types_stay_apart(
        monkeypatch: Any) -> None:
    keep = Keep()
    values: list[Any] = [1, True, 1.0, 0, False, 0.0, -0.0, float("nan"), -2**63, -1, 8001]
    records: list[Any] = [(0xABC, "", 0x1000 + i, 0, 10, 20, {"v": v}, None, ()) for i, v in enumerate(values)]
    assert wire(keep, records) == sdk(keep, records)  # 1 / True / 1.0 and 0.0 / -0.0 each encoded as itself
    calls = [0]
    real = otlp_wire._value

    def counting(v: Any) -> bytes:
        calls[0] += 1
        return real(v)

    monkeypatch.setattr(otlp_wire, "_value", counting)
    assert wire(keep, records) == sdk(keep, records)  # the second time from what was kept
    assert calls[0] == 0


def test_the_http_exporter_is_handed_the_encoded_bytes_without_a_parse_into_a_message(monkeypatch: Any) -> None:
    monkeypatch.setattr(http_module, "encode_spans", http_module.encode_spans)

    def no_parse(data: bytes) -> Any:
        raise AssertionError("parsed into a message")

    monkeypatch.setattr(trace_service_pb2.ExportTraceServiceRequest, "FromString", no_parse)
    with http_bodies() as (port, bodies):
        exporter = HttpExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces")
        assert otlp_wire.install(exporter)
        batch = Keep()._encoded([(0xABC, "", 0x1234, 0, 10, 20, {"a": 7}, None, ())])
        assert exporter.export(batch) is SpanExportResult.SUCCESS
        exporter.shutdown()
    assert bodies == [("/v1/traces", batch.payload)]


def test_a_value_the_protocol_cannot_hold_is_skipped_as_the_sdk_skips_it() -> None:
    keep = Keep()
    record: Record = (0xABC, "", 0x1234, 0, 10, 20, {"ok": 1, "bad": object(), "after": "x"}, None, ())
    assert wire(keep, [record]) == sdk(keep, [record])
