"""The conformance checker's reading of answers, on hand-built ext_proc responses (no sockets): the rules a
fake picker in tests/integration/test_conformance.py cannot break without failing other checks too."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from epp_extproc.conformance.checks import destination_verdict
from epp_extproc.conformance.protocol import Answer, is_endpoint_list, request_messages
from epp_extproc.gaie import DEST_HEADER, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE


def routed(header: str | None, metadata: object) -> Answer:
    mutation = pb.HeaderMutation()
    if header is not None:
        mutation.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DEST_HEADER, raw_value=header.encode())))
    resp = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
        header_mutation=mutation)))
    if metadata is not None:
        md = struct_pb2.Struct()
        md.update({LB_NAMESPACE: {DEST_HEADER: metadata}})
        resp.dynamic_metadata.CopyFrom(md)
    return Answer(responses=[resp])


def test_header_and_metadata_naming_different_endpoints_fail() -> None:
    v = destination_verdict(routed("10.0.0.1:8000", "10.0.0.2:8000"))
    assert v.status == "fail" and "differ" in v.why


def test_the_same_endpoint_in_header_and_metadata_passes() -> None:
    assert destination_verdict(routed("10.0.0.1:8000", "10.0.0.1:8000")).status == "pass"


def test_a_fallback_list_in_metadata_as_a_list_reads_as_the_header_string() -> None:
    assert destination_verdict(routed("10.0.0.1:8000,10.0.0.2:8000", ["10.0.0.1:8000", "10.0.0.2:8000"])).status == "pass"


def test_a_host_name_destination_fails_the_ip_port_form() -> None:
    v = destination_verdict(routed("worker-0:8000", "worker-0:8000"))
    assert v.status == "fail" and "ip:port" in v.why


def test_a_missing_header_fails_even_with_metadata() -> None:
    assert destination_verdict(routed(None, "10.0.0.1:8000")).status == "fail"


def test_endpoint_lists_accept_ipv6_and_refuse_ports_out_of_range() -> None:
    assert is_endpoint_list("[::1]:8000,10.0.0.1:1")
    assert not is_endpoint_list("10.0.0.1:0") and not is_endpoint_list("10.0.0.1") and not is_endpoint_list("")


def test_the_subset_hint_rides_on_every_message_as_envoy_sends_it() -> None:
    first, rest = request_messages("FULL_DUPLEX_STREAMED", b"x" * 40_000, subset=["10.0.0.1:8000"])
    assert len(rest) == 3 and rest[-1].request_body.end_of_stream and not rest[0].request_body.end_of_stream
    for m in (first, *rest):
        hint = m.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET_KEY]
        assert [x.string_value for x in hint.list_value.values] == ["10.0.0.1:8000"]
    _, buffered = request_messages("BUFFERED", b"x" * 40_000)
    assert len(buffered) == 1 and buffered[0].request_body.end_of_stream
