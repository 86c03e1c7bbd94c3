"""The picker's sampled requests as one OTLP `ExportTraceServiceRequest`, encoded straight from its records.

Why not the SDK's `encode_spans`: it builds a protobuf object per span, per attribute and per value, and
copies each into its parent; for the four or five spans of a sampled request that was about 100 us of the
picker's CPU (bench/bench_tracing.py, `picker10`), most of what 10% sampling costs. The wire format is small
and fixed (opentelemetry-proto's `trace.proto`, `common.proto`, `resource.proto`), so the records are written
as its bytes directly, about six times faster, and handed to the SDK's own OTLP exporters (HTTP and gRPC,
with their retries, headers, TLS and compression) through `install`. The bytes equal the SDK's encoding of
the same spans (tests/unit/test_tracing_wire.py compares them), so a collector cannot tell the difference.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags: the parent's "is remote" is known, and true
_F64 = struct.Struct("<Q").pack
_D64 = struct.Struct("<d").pack
_F32 = struct.Struct("<I").pack


def varint(n: int) -> bytes:
    """A protobuf varint (also the edge's header mutation wire bytes: envoy/extproc.py)."""
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:  # a span's length, most attributes' blocks: two bytes, no loop
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (tag already holds the field number and wire type 2)."""
    n = len(payload)
    return bytes((tag, n)) + payload if n < 0x80 else bytes((tag,)) + varint(n) + payload


def _string(tag: int, text: str) -> bytes:
    return _ld(tag, text.encode()) if text else b""


def _value(v: Any) -> bytes:
    """An AnyValue (common.proto): the types a span's attributes hold here; another type goes through the
    SDK's own encoder, so nothing an attribute may legally hold is refused."""
    if v.__class__ is str:
        return _ld(0x0A, v.encode())  # string_value = 1
    if v.__class__ is bool:
        return b"\x10\x01" if v else b"\x10\x00"  # bool_value = 2
    if v.__class__ is int:
        return b"\x18" + varint(v & 0xFFFFFFFFFFFFFFFF)  # int_value = 3 (int64: two's complement)
    if v.__class__ is float:
        return b"\x21" + _D64(v)  # double_value = 4
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_value

    return _encode_value(v).SerializeToString()


_KEYS: dict[str, bytes] = {}  # a key's field, encoded once: the picker's attribute names are a few dozen
# A whole KeyValue with a string value, encoded once: most of a span's strings repeat (a method, a server, an
# endpoint, a model, a route). Bounded: past the bound, new pairs are encoded every time and not kept.
_PAIRS: dict[tuple[int, str, str], bytes] = {}
# The same for ints, bools and floats (a port, a status code, a candidate count, a cost of 0.0): bounded apart,
# so that values that never repeat (token counts, timings) fill this one and not the strings'.
_SCALARS: dict[tuple[int, str, type, Any], bytes] = {}  # (tag, key, type, value or a float's bits)
_MAX_KEYS = 1024
_MAX_PAIRS = 2048


def _key(k: str) -> bytes:
    field = _KEYS.get(k)
    if field is None:
        field = _ld(0x0A, k.encode())
        if len(_KEYS) < _MAX_KEYS:
            _KEYS[k] = field
    return field


def attributes(tag: int, attrs: Mapping[str, Any]) -> bytes:
    """Repeated KeyValue under field `tag`: key = 1, value = 2."""
    out = []
    for k, v in attrs.items():
        cls = v.__class__
        if cls is str:
            kv = _PAIRS.get((tag, k, v))
            if kv is None:
                kv = _ld(tag, _key(k) + _ld(0x12, _ld(0x0A, v.encode())))
                if len(_PAIRS) < _MAX_PAIRS:
                    _PAIRS[(tag, k, v)] = kv
        elif cls is int or cls is bool or cls is float:
            # keyed by the value's type too (1, True and 1.0 are equal keys, three encodings), a float by its
            # bits (0.0 and -0.0 are equal too; a NaN equals nothing)
            key = (tag, k, cls, _D64(v) if cls is float else v)
            kv = _SCALARS.get(key)
            if kv is None:
                kv = _ld(tag, _key(k) + _ld(0x12, _value(v)))
                if len(_SCALARS) < _MAX_PAIRS:
                    _SCALARS[key] = kv
        else:
            try:
                kv = _ld(tag, _key(k) + _ld(0x12, _value(v)))
            except Exception:  # a value the protocol has no type for: skipped, as the SDK's encoder skips it
                log.exception("tracing: attribute %s not encoded", k)
                continue
        out.append(kv)
    return b"".join(out)


_NAMES: dict[str, bytes] = {}  # a span's name field, encoded once (the picker's span names are a handful)
_NO_STATUS = b"\x7A\x00"  # an empty Status (UNSET, no message)
_FLAGS = {True: b"\x85\x01" + _F32(_HAS_IS_REMOTE | _IS_REMOTE), False: b"\x85\x01" + _F32(_HAS_IS_REMOTE)}
_FLAGS_REMOTE, _FLAGS_LOCAL = _FLAGS[True], _FLAGS[False]
# the fixed-size fields, packed in one call each: span_id = 2 (the id's 8 bytes, big-endian as the SDK writes
# ids), with or without parent_span_id = 4 after it; kind = 6, start = 7 and end = 8 (fixed64, little-endian)
_SID = struct.Struct(">Q").pack
_SID_PARENT = struct.Struct(">QHQ").pack
_PARENT = struct.Struct(">HQ").pack
_TIMES = struct.Struct("<BBBQBQ").pack
_HEAD = struct.Struct(">HQQH").pack
_LOW64 = (1 << 64) - 1


def span_head(trace_id: int) -> bytes:
    """A span's first bytes up to its span id's value: trace_id = 1 (16 bytes) and span_id's tag and length;
    the same for every span of a trace (`span` takes it made once)."""
    return _HEAD(0x0A10, trace_id >> 64, trace_id & _LOW64, 0x1208)


def trace_state(text: str) -> bytes:
    """A span's trace_state = 3 field (empty: none), the same for every span of a trace."""
    return _string(0x1A, text)


def span(head: bytes, span_id: int, state: bytes, parent_id: int, parent_remote: bool, name: str,
         kind: int, start: int, end: int, attrs: Mapping[str, Any], status: tuple[int, str] | None) -> bytes:
    """One Span (trace.proto), its fields in number order as protobuf's own encoder writes them. `head`:
    `span_head(trace id)`; `state`: `trace_state(its text)`; `kind` is the SDK's SpanKind value (the wire's is one
    more); `status` (code, message) or None for UNSET."""
    if state:
        ids = _SID(span_id) + state + (_PARENT(0x2208, parent_id) if parent_id else b"")
    elif parent_id:
        ids = _SID_PARENT(span_id, 0x2208, parent_id)
    else:
        ids = _SID(span_id)
    field = _NAMES.get(name)
    if field is None:
        field = _string(0x2A, name)
        if len(_NAMES) < _MAX_KEYS:
            _NAMES[name] = field
    if status is None:
        st = _NO_STATUS
    else:
        code, message = status
        st = _ld(0x7A, _string(0x12, message) + (b"\x18" + varint(code) if code else b""))
    return b"".join((head, ids, field, _TIMES(0x30, kind + 1, 0x39, start, 0x41, end), attributes(0x4A, attrs), st,
                     _FLAGS_REMOTE if parent_id and parent_remote else _FLAGS_LOCAL))


def envelope(resource_attrs: Mapping[str, Any], resource_schema: str, scope_name: str, scope_version: str
             ) -> tuple[bytes, bytes, bytes]:
    """What `request` writes around the spans, the same for every batch of one picker: (the Resource field, the
    scope field, the schema_url field); made once (`request_from`)."""
    return (_ld(0x0A, attributes(0x0A, resource_attrs)), _ld(0x0A, _string(0x0A, scope_name) +
            _string(0x12, scope_version)), _string(0x1A, resource_schema))


def request_from(env: tuple[bytes, bytes, bytes], spans: Iterable[bytes]) -> bytes:
    """ExportTraceServiceRequest { ResourceSpans { Resource, ScopeSpans { scope, spans } } } around `spans`
    (each `span`'s bytes), its `envelope` made before: one resource and one instrumentation scope, the picker's."""
    resource, scope, schema = env
    body = [scope]
    append = body.append
    for s in spans:
        n = len(s)
        append(bytes((0x12, n)) if n < 0x80 else bytes((0x12, (n & 0x7F) | 0x80, n >> 7)) if n < 0x4000
               else b"\x12" + varint(n))
        append(s)
    scope_spans = _ld(0x12, b"".join(body))
    return _ld(0x0A, resource + scope_spans + schema)


def request(resource_attrs: Mapping[str, Any], resource_schema: str, scope_name: str, scope_version: str,
            spans: Iterable[bytes]) -> bytes:
    """`request_from` with the envelope made for this call."""
    return request_from(envelope(resource_attrs, resource_schema, scope_name, scope_version), spans)


class Encoded(Sequence[bytes]):
    """A batch already on the wire, handed to the SDK's exporter in place of its spans: its length is the
    number of spans (the exporter's own metrics count them), `payload` the request's bytes."""

    __slots__ = ("_spans", "payload")

    def __init__(self, spans: list[bytes], payload: bytes) -> None:
        self._spans = spans
        self.payload = payload

    def __len__(self) -> int:
        return len(self._spans)

    def __getitem__(self, i: Any) -> Any:
        return self._spans[i]


class _Serialized:
    """An encoded request as the HTTP exporter uses the message `encode_spans` returns: it asks for its bytes,
    which are these (no parse into a message and serialization back, ~2.5 us per sampled request)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def SerializePartialToString(self) -> bytes:  # noqa: N802 - protobuf's name
        return self.payload

    SerializeToString = SerializePartialToString


_MODULES = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
            "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")


def install(exporter: object) -> bool:
    """Let `exporter` (the SDK's OTLP span exporter, HTTP or gRPC) take an `Encoded` batch: both call their
    module's `encode_spans` on what `export` is given; that name is wrapped to pass an `Encoded` batch's
    bytes through (parsed once by protobuf's C code, as the gRPC stub needs a message) and to hand anything
    else to the SDK's function, unchanged. False, and nothing changed, when this exporter's module has no such
    name (another SDK release): the caller then gives it the SDK's span objects, as before."""
    import importlib

    module_name = type(exporter).__module__
    if module_name not in _MODULES:
        return False
    module = importlib.import_module(module_name)
    current = getattr(module, "encode_spans", None)
    if current is None:
        log.info("tracing: %s has no encode_spans; spans are encoded by the SDK", module_name)
        return False
    if getattr(current, "_epp_passes_encoded", False):
        return True
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    sdk_encode = current
    # the HTTP exporter only serializes what it gets (`SerializePartialToString`): it takes the bytes as they
    # are; the gRPC stub's serializer needs a real message, parsed once by protobuf's C code
    http = module_name == _MODULES[0]

    def encode_spans(spans: Any) -> Any:
        if isinstance(spans, Encoded):
            return _Serialized(spans.payload) if http else ExportTraceServiceRequest.FromString(spans.payload)
        return sdk_encode(spans)

    encode_spans._epp_passes_encoded = True  # type: ignore[attr-defined]
    module.encode_spans = encode_spans
    return True
