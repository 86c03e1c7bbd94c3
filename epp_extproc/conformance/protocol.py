"""The ext_proc messages a gateway sends an endpoint picker, and what a picker's answers say.

Built the way Envoy builds them: `protocol_config` on the first message of a stream, headers as `raw_value`,
the gateway's subset hint as filter metadata (namespace `envoy.lb.subset_hint`) on every message. Reading an
answer collects everything the request phase set, so a check can ask "where did the destination appear?"
whichever message (headers or body response) the picker chose to carry it in.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from epp_extproc.gaie import DEST_HEADER, LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE

__all__ = ["BUFFERED", "FULL_DUPLEX", "Answer", "chat_body", "first_endpoint", "is_endpoint_list", "request_messages",
           "served_message"]

_Mode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX = "FULL_DUPLEX_STREAMED"
BUFFERED = "BUFFERED"
STREAM_CHUNK = 16_384  # Envoy forwards a streamed body in pieces; two pieces show a picker that reads only one


def chat_body(model: str, salt: str = "") -> bytes:
    """A small, valid OpenAI chat request: any picker must be able to route it."""
    return json.dumps({"model": model, "max_tokens": 1,
                       "messages": [{"role": "user", "content": f"endpoint picker conformance check {salt} " * 40}]}
                      ).encode()


def _subset_metadata(subset: Sequence[str]) -> base_pb2.Metadata:
    s = struct_pb2.Struct()
    s.update({SUBSET_KEY: list(subset)})
    md = base_pb2.Metadata()
    md.filter_metadata[SUBSET_NAMESPACE].CopyFrom(s)
    return md


def request_messages(mode: str, body: bytes, *, headers: Iterable[tuple[str, str]] = (),
                     subset: Sequence[str] | None = None, authority: str = "conformance.test") \
        -> tuple[pb.ProcessingRequest, list[pb.ProcessingRequest]]:
    """(request_headers, body messages) for one POST /v1/chat/completions in `mode`. FULL_DUPLEX_STREAMED
    sends the body in pieces as Envoy streams it; BUFFERED sends it whole, once the headers were answered."""
    hs = [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", authority), (":scheme", "http"),
          ("content-type", "application/json"), ("content-length", str(len(body))), *headers]
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])))
    first.protocol_config.request_body_mode = _Mode.Value(mode)
    first.protocol_config.response_body_mode = _Mode.Value(FULL_DUPLEX if mode == FULL_DUPLEX else "NONE")
    step = STREAM_CHUNK if mode == FULL_DUPLEX else max(len(body), 1)
    pieces = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
    rest = [pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(pieces) - 1))
            for i, p in enumerate(pieces)]
    if subset is not None:
        md = _subset_metadata(subset)
        for m in (first, *rest):
            m.metadata_context.CopyFrom(md)
    return first, rest


def served_message(address: str) -> pb.ProcessingRequest:
    """The upstream's response headers as the gateway sends them, reporting in `envoy.lb` metadata the endpoint
    that really served the request."""
    s = struct_pb2.Struct()
    s.update({SERVED_KEY: address})
    m = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200"),
        base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")])))
    m.metadata_context.filter_metadata[LB_NAMESPACE].CopyFrom(s)
    return m


def is_endpoint_list(value: str) -> bool:
    """`ip:port` or `ip:port,ip:port,...` (IPv6 as `[addr]:port`), as the protocol requires."""
    parts = value.split(",")
    return bool(parts) and all(_is_endpoint(p.strip()) for p in parts)


def _is_endpoint(s: str) -> bool:
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def first_endpoint(value: str) -> str:
    """The primary endpoint of a destination value ("the first valid endpoint in the list will be used")."""
    return value.split(",")[0].strip()


@dataclass
class Answer:
    """What one request's ext_proc stream answered during the request phase."""

    responses: list[pb.ProcessingResponse] = field(default_factory=list)
    grpc_error: str | None = None  # the stream ended with this gRPC status (e.g. FAILED_PRECONDITION: ...)
    timed_out: bool = False
    after: list[pb.ProcessingResponse] = field(default_factory=list)  # answers to the response-phase messages

    @property
    def immediate(self) -> pb.ImmediateResponse | None:
        for r in self.responses:
            if r.HasField("immediate_response"):
                return r.immediate_response
        return None

    @property
    def immediate_status(self) -> int | None:
        imm = self.immediate
        return None if imm is None else imm.status.code

    def _commons(self) -> list[pb.CommonResponse]:
        out = []
        for r in self.responses:
            kind = r.WhichOneof("response")
            if kind in ("request_headers", "request_body", "request_trailers"):
                out.append(getattr(r, kind).response)
        return out

    def header_sets(self) -> list[base_pb2.HeaderValueOption]:
        """Every `x-gateway-destination-endpoint` the request phase's header mutations set."""
        return [h for c in self._commons() for h in c.header_mutation.set_headers
                if h.header.key.lower() == DEST_HEADER]

    def header_values(self) -> list[str]:
        return [(h.header.raw_value.decode("utf-8", "replace") if h.header.raw_value else h.header.value)
                for h in self.header_sets()]

    def removed_headers(self) -> set[str]:
        return {name.lower() for c in self._commons() for name in c.header_mutation.remove_headers}

    def metadata_values(self) -> list[str]:
        """Every `envoy.lb` / `x-gateway-destination-endpoint` in the answers' dynamic metadata (a string, or
        a list of strings joined by commas)."""
        out = []
        for r in self.responses:
            ns = r.dynamic_metadata.fields.get(LB_NAMESPACE) if r.HasField("dynamic_metadata") else None
            if ns is None or ns.WhichOneof("kind") != "struct_value" or DEST_HEADER not in ns.struct_value.fields:
                continue
            v = ns.struct_value.fields[DEST_HEADER]
            kind = v.WhichOneof("kind")
            if kind == "string_value":
                out.append(v.string_value)
            elif kind == "list_value":
                out.append(",".join(x.string_value for x in v.list_value.values))
            else:
                out.append(f"<{kind}>")
        return out

    def destinations(self) -> list[str]:
        """Every destination value named anywhere (header or metadata)."""
        return self.header_values() + self.metadata_values()

    def summary(self) -> str:
        """One line for a failure message: what came back."""
        if self.grpc_error:
            return f"stream failed: {self.grpc_error}"
        if self.immediate is not None:
            return f"ImmediateResponse {self.immediate_status}"
        kinds = [r.WhichOneof("response") or "?" for r in self.responses]
        return (f"answers {kinds or 'none'}{' (timed out)' if self.timed_out else ''}; header "
                f"{self.header_values() or 'unset'}, metadata {self.metadata_values() or 'unset'}")
