"""Hostile input: bodies, headers and KV events chosen to break the picker, each with a defined outcome.

Property tests (hypothesis) cover the byte-preserving body rewrite, the KV-event decoder and header parsing
over real gRPC; explicit cases go through a real Envoy with a mock renderer and echo upstreams that record
exactly what they received. Nothing here may make the picker name an address it did not discover.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import zmq
import zmq.asyncio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.core.body import BodyError, parse_object, rewrite
from epp_extproc.dev import envoy_config
from kvindex.decode import MAX_HASHES_PER_EVENT, decode_payload
from kvindex.index import KvIndex
from kvindex.subscriber import SubscriberManager
from tests.gateway_client import Reply, request
from tests.harness import BackgroundLoop, EchoUpstream, EnvoyProcess
from tests.netutil import free_port
from tests.stack import MockProc

DEST = "x-gateway-destination-endpoint"
MAX_BODY = 1024 * 1024
FIXED = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# ------------------------------------------------------------------------------------------ JSON strategies
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                                     max_size=4),
                      max_leaves=16)
keys = st.text(max_size=10).filter(lambda k: k != "nvext")


@st.composite
def json_objects(draw: st.DrawFn) -> tuple[bytes, bytes, dict[str, Any]]:
    """(raw body, the body the picker must forward, its expected parse) with random formatting and an
    optional nvext member (object or null) anywhere, once or twice."""
    members = draw(st.dictionaries(keys, values, max_size=6))
    ascii_ = draw(st.booleans())
    kv_sep = draw(st.sampled_from([":", " : ", ":\n  "]))
    sep = draw(st.sampled_from([",", ", ", " ,\n ", ",\t"]))
    pad = draw(st.sampled_from(["", " ", "\n", " \r\n\t"]))

    def member(k: str, v: Any) -> str:
        return json.dumps(k, ensure_ascii=ascii_) + kv_sep + json.dumps(v, ensure_ascii=ascii_)

    items = [(member(k, v), False) for k, v in members.items()]
    for _ in range(draw(st.integers(0, 2))):
        nv = draw(st.none() | st.dictionaries(st.text(max_size=6), values, max_size=3))
        items.insert(draw(st.integers(0, len(items))), (member("nvext", nv), True))
    prefix, suffix = "{" + pad, pad + "}"
    raw = prefix + sep.join(t for t, _ in items) + suffix
    kept = [t for t, nvext in items if not nvext]
    expected = prefix + sep.join(kept) + suffix if len(kept) < len(items) else raw
    return raw.encode(), expected.encode(), members


@FIXED
@given(json_objects())
def test_any_json_object_is_forwarded_minus_nvext_with_every_other_member_byte_exact(
        case: tuple[bytes, bytes, dict[str, Any]]) -> None:
    raw, expected, members = case
    out = rewrite(parse_object(raw), raw, drop=frozenset({"nvext"}))
    assert out == expected
    assert json.loads(out) == members
    if expected == raw:
        assert out is raw  # nothing to drop: the very same bytes object, no copy


@FIXED
@given(st.binary(max_size=300))
def test_any_bytes_as_a_body_parse_or_raise_only_body_error(data: bytes) -> None:
    try:
        parse_object(data)
    except BodyError:
        pass


def test_duplicate_members_are_all_forwarded_and_every_nvext_is_dropped() -> None:
    raw = b'{"a":1,"nvext":{"x":1},"a":2,"nvext":null,"b":[1,2],"b":3}'
    parsed = parse_object(raw)
    assert parsed.values == {"a": 2, "nvext": None, "b": 3}  # last occurrence wins, as in json.loads
    assert rewrite(parsed, raw, drop=frozenset({"nvext"})) == b'{"a":1,"a":2,"b":[1,2],"b":3}'


def test_integer_longer_than_pythons_digit_limit_is_parsed_not_a_crash() -> None:
    huge = b"9" * 5000  # > sys.get_int_max_str_digits(): int() raises a plain ValueError
    raw = b'{"seed":' + huge + b',"nvext":{},"max_tokens":-' + huge + b"}"
    parsed = parse_object(raw)
    assert parsed.values["seed"] == float("inf") and parsed.values["max_tokens"] == float("-inf")
    assert rewrite(parsed, raw, drop=frozenset({"nvext"})) == b'{"seed":' + huge + b',"max_tokens":-' + huge + b"}"


@pytest.mark.parametrize(("raw", "reason"), [
    (b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nesting too deep"),
    (b'{"a":' + b'{"b":' * 100_000 + b"1" + b"}" * 100_001, "nesting too deep"),
    (b'{"a":"\xff\xfe"}', "not valid UTF-8"),
    (b'\xef\xbb\xbf{"a":1}', "byte-order mark"),
    (b'{"a":NaN', "malformed JSON"),
    (b"[1,2]", "must be a JSON object"),
    (b'{"a":1} {"b":2}', "trailing data"),
])
def test_hostile_bodies_are_a_short_body_error(raw: bytes, reason: str) -> None:
    with pytest.raises(BodyError, match=reason):
        parse_object(raw)


# ------------------------------------------------------------------------------------------ KV-event decoder
mp_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
              | st.binary(max_size=8))
mp_values = st.recursive(mp_scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=6),
                                                                                         c, max_size=5),
                         max_leaves=30)
event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", 7])},
    optional={"block_hashes": st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4) | mp_values,
              "parent_block_hash": st.none() | st.integers(-(2**63), 2**64 - 1) | mp_values,
              "token_ids": st.lists(st.integers(-5, 2**33), max_size=12) | mp_values,
              "block_size": st.integers(-2, 5) | mp_values, "medium": st.sampled_from(["GPU", "cpu", None]),
              "lora_name": st.none() | st.text(max_size=4), "group_idx": st.integers(-1, 2)})
batches = st.tuples(st.integers(0, 2**40) | st.floats() | mp_values,
                    st.lists(event_like | mp_values, max_size=6), st.integers(-1, 3) | st.none())


def apply_and_count(payload: bytes) -> KvIndex:
    idx = KvIndex(2)
    idx.apply_batch("w", decode_payload(payload))
    s = idx.stats("w")
    assert (s.batches, s.garbage_batches) in ((1, 0), (0, 1))  # applied, or counted as garbage: never both
    assert idx.workers() == ["w"]  # whatever the payload says, only the worker it came from holds anything
    return idx


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_fed_to_the_decoder_are_applied_or_counted_as_garbage(data: bytes) -> None:
    apply_and_count(data)


@settings(max_examples=300, deadline=None)
@given(batches)
def test_any_msgpack_batch_shaped_like_kv_events_is_applied_or_counted(batch: tuple[Any, Any, Any]) -> None:
    apply_and_count(msgpack.packb(list(batch), use_bin_type=True))


# ------------------------------------------------------------------------------------------ headers over gRPC
@pytest.fixture(scope="module")
def grpc_picker() -> Iterator[tuple[PickerApp, pb_grpc.ExternalProcessorStub]]:
    bg = BackgroundLoop()
    cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                 endpoints="a=127.0.0.1:9,b=127.0.0.1:10", endpoint_probe_interval_ms=0,
                 secure_serving=False)  # a plaintext client: the input is the point, not TLS
    app = PickerApp(cfg)
    bg.run(app.start())
    ch = grpc.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    yield app, pb_grpc.ExternalProcessorStub(ch)
    ch.close()
    bg.run(app.stop())
    bg.close()


header_names = st.sampled_from([":method", ":path", "x-tenant-id", "content-type", "X-Gateway-Destination-Endpoint",
                                "x-gateway-destination-endpoint-served", "x-gateway-destination-endpoint-subset",
                                "content-length"]) | st.text(min_size=1, max_size=30)
header_lists = st.lists(st.tuples(header_names, st.binary(max_size=300), st.booleans()), max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header_lists, st.booleans())
def test_odd_header_bytes_never_crash_the_picker_and_only_discovered_addresses_are_named(
        grpc_picker: tuple[PickerApp, pb_grpc.ExternalProcessorStub], hdrs: list[tuple[str, bytes, bool]],
        with_body: bool) -> None:
    _, stub = grpc_picker
    hv = [base_pb2.HeaderValue(key=k, raw_value=v) if raw else
          base_pb2.HeaderValue(key=k, value=v.decode("latin-1")) for k, v, raw in hdrs]
    msgs = [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv),
                                                                end_of_stream=not with_body))]
    if with_body:
        msgs.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model":"m"}', end_of_stream=True)))
    call = stub.Process(iter(msgs), timeout=10)
    first = next(call)
    call.cancel()
    kind = first.WhichOneof("response")
    assert kind in ("request_headers", "immediate_response")
    if kind == "request_headers":
        mut = first.request_headers.response.header_mutation
        named = [h.header.raw_value.decode() for h in mut.set_headers if h.header.key == DEST]
        assert named and set(named) <= {"127.0.0.1:9", "127.0.0.1:10"}
        spoofed = {k.lower() for k, _, _ in hdrs if k.lower().startswith(DEST)} - {DEST}
        assert spoofed <= set(mut.remove_headers)


# ------------------------------------------------------------------------------------------ through Envoy
class EchoGateway:
    """Envoy -> picker (trtllm-render via a mock renderer process, salts load-only) -> two echo upstreams;
    a third echo upstream exists but is never discovered: the address a spoofer would like to reach."""

    def __init__(self, tmp: Path) -> None:
        self.bg = BackgroundLoop()
        self.a, self.b, self.evil = EchoUpstream("a"), EchoUpstream("b"), EchoUpstream("evil")
        for u in (self.a, self.b, self.evil):
            self.bg.run(u.start())
        rport = free_port()
        mock = str(Path(sys.executable).parent / "trtllm-mock")
        self.renderer = MockProc("renderer", [mock, "--role", "renderer", "--port", str(rport)], rport,
                                 log=tmp / "renderer.log").start()
        cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                     endpoints=f"a={self.a.address},b={self.b.address}", max_body_bytes=MAX_BODY,
                     tokenizer_protocol="trtllm-render", tokenizer_service_url=self.renderer.url,
                     cache_salt_policy="load-only", endpoint_probe_interval_ms=0)
        self.app = PickerApp(cfg)
        self.app.kv.facts.ask_server_info = False  # type: ignore[union-attr]  (echo upstreams have no /server_info)
        self.bg.run(self.app.start())
        self.envoy = EnvoyProcess(envoy_config.EnvoyOptions(picker_port=self.app.grpc_port,
                                                            subset_hint_header="x-test-subset")).start()

    def post(self, body: bytes, headers: dict[str, str] | list[tuple[str, str]] | None = None,
             path: str = "/v1/chat/completions") -> Reply:
        return request(self.envoy.url, body=body, headers=headers, path=path)

    def seen(self, r: Reply) -> Any:
        return {"a": self.a, "b": self.b}[r.headers["x-upstream-name"]].seen[-1]

    def close(self) -> None:
        self.envoy.stop()
        self.bg.run(self.app.stop())
        for u in (self.a, self.b, self.evil):
            self.bg.run(u.stop())
        self.renderer.stop()
        self.bg.close()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EchoGateway]:
    g = EchoGateway(tmp_path_factory.mktemp("hostile"))
    yield g
    g.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(json_objects())
def test_any_json_object_through_envoy_reaches_the_worker_minus_nvext_byte_exact(
        gw: EchoGateway, case: tuple[bytes, bytes, dict[str, Any]]) -> None:
    raw, expected, _ = case
    r = gw.post(raw, path="/v1/embeddings")  # a route the picker does not render, so no salt is injected
    assert r.status == 200
    assert gw.seen(r).body == expected


def test_body_over_the_limit_is_413_and_reaches_no_worker(gw: EchoGateway) -> None:
    n = len(gw.a.seen) + len(gw.b.seen)
    r = gw.post(b'{"model":"m","pad":"' + b"x" * MAX_BODY + b'"}')
    assert r.status == 413 and b"larger than" in r.body
    assert len(gw.a.seen) + len(gw.b.seen) == n


def test_recursion_bomb_is_400_and_the_picker_keeps_serving(gw: EchoGateway) -> None:
    r = gw.post(b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert r.status == 400 and b"nesting too deep" in r.body
    assert gw.post(b'{"model":"m","messages":[]}').status == 200


def test_non_utf8_body_is_400(gw: EchoGateway) -> None:
    r = gw.post(b'{"model":"m","messages":[{"role":"user","content":"\xc3\x28"}]}')
    assert r.status == 400 and b"not valid UTF-8" in r.body


def test_out_of_range_numbers_are_forwarded_untouched_for_the_worker_to_judge(gw: EchoGateway) -> None:
    raw = (b'{"model":"m","messages":[{"role":"user","content":"n"}],"max_tokens":1e999,"seed":'
           + b"7" * 5000 + b',"temperature":-0.0,"top_p":1E-400,"nvext":{"x":1}}')
    r = gw.post(raw)
    assert r.status == 200
    assert gw.seen(r).body == raw.replace(b',"nvext":{"x":1}', b"")


def test_duplicate_nvext_members_are_all_dropped(gw: EchoGateway) -> None:
    r = gw.post(b'{"nvext":{},"model":"m","nvext":null,"messages":[],"nvext":{"a":[1]}}')
    assert r.status == 200
    assert gw.seen(r).body == b'{"model":"m","messages":[]}'


def test_large_and_repeated_headers_are_routed_and_oversized_ones_refused_by_envoy(gw: EchoGateway) -> None:
    big = gw.post(b'{"model":"m"}', headers={"x-junk": "j" * 8000})  # the echo upstream's own line cap: 8 KiB
    assert big.status == 200 and gw.seen(big).headers["x-junk"] == "j" * 8000
    many = gw.post(b'{"model":"m"}', headers=[("x-junk", f"v{i}") for i in range(90)])  # Envoy allows 100
    assert many.status == 200 and gw.seen(many).headers["x-junk"].startswith("v0")
    routed = len(gw.a.seen) + len(gw.b.seen)
    # over Envoy's 60 KiB header cap or its 100-header cap: Envoy closes the connection (or answers 431)
    for headers in ([("x-junk", "j" * 100_000)], [("x-junk", f"v{i}") for i in range(500)]):
        try:
            assert gw.post(b'{"model":"m"}', headers=headers).status == 431
        except ConnectionError:
            pass
    assert len(gw.a.seen) + len(gw.b.seen) == routed


def test_spoofed_destination_headers_in_every_spelling_are_replaced_by_the_pick(gw: EchoGateway) -> None:
    evil = gw.evil.address
    headers = [("X-Gateway-Destination-Endpoint", evil), ("x-gateway-destination-endpoint", f"{evil},{evil}"),
               ("x-gateway-destination-endpoint-served", evil), ("x-gateway-destination-endpoint-subset", evil),
               ("x-gateway-destination-endpoint-fallback", evil)]
    for path, body in (("/v1/chat/completions", b'{"model":"m","messages":[]}'), ("/v1/models", None)):
        r = request(gw.envoy.url, method="POST" if body else "GET", path=path, body=body, headers=headers)
        assert r.status == 200
        seen = gw.seen(r)
        assert seen.headers[DEST] in (gw.a.address, gw.b.address)
        assert not [k for k in seen.headers if k.lower().startswith(DEST) and k.lower() != DEST]
    assert gw.evil.seen == []


def test_subset_hint_naming_only_an_undiscovered_address_is_503_never_that_address(gw: EchoGateway) -> None:
    r = gw.post(b'{"model":"m","messages":[]}', headers={"x-test-subset": gw.evil.address})
    assert r.status == 503
    assert gw.evil.seen == []


@pytest.mark.parametrize(("headers", "body", "forwarded_salt"), [
    ([("x-tenant-id", "tenant-a")], {"cache_salt": "tenant-b"}, "tenant-a"),  # the gateway's header wins
    ([("x-tenant-id", "tenant-a"), ("x-tenant-id", "tenant-b")], {}, "tenant-b"),  # last non-empty value
    ([("x-tenant-id", "tenant-a"), ("x-tenant-id", "   ")], {}, "tenant-a"),  # blank values are ignored
    ([("x-tenant-id", "  ")], {"nvext": {"cache_salt": "n"}, "cache_salt": "c"}, "n"),  # nvext > top level
    ([], {"cache_salt": "c"}, "c"),
])
def test_tenant_salt_games_forward_exactly_one_salt_chosen_by_the_documented_order(
        gw: EchoGateway, headers: list[tuple[str, str]], body: dict[str, Any], forwarded_salt: str) -> None:
    doc = {"model": "m", "messages": [{"role": "user", "content": "whose cache?"}], **body}
    r = gw.post(json.dumps(doc).encode(), headers=headers)
    assert r.status == 200
    fwd = json.loads(gw.seen(r).body)
    assert fwd["cache_salt"] == forwarded_salt and "nvext" not in fwd
    assert gw.seen(r).body.count(b'"cache_salt"') == 1


def test_non_utf8_tenant_header_is_a_salt_not_a_crash(gw: EchoGateway) -> None:
    r = gw.post(b'{"model":"m","messages":[]}', headers=[("x-tenant-id", "t\udcff".encode("utf-8", "surrogateescape").decode("latin-1"))])
    assert r.status in (200, 400)  # Envoy may refuse the byte itself; the picker never 500s on it
    assert r.status != 500


# ------------------------------------------------------------------------------------------ hostile worker
async def test_worker_publishing_absurd_events_is_counted_and_only_its_own_real_claims_count() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    idx = KvIndex(2)
    mgr = SubscriberManager(idx, zmq_context=ctx)
    await mgr.add("10.0.0.7:8000", f"tcp://127.0.0.1:{port}")
    seq = 0

    async def send(frames: list[bytes]) -> None:
        await pub.send_multipart(frames)

    def batch(events: list[dict[str, Any]]) -> list[bytes]:
        nonlocal seq
        seq += 1
        return [b"", seq.to_bytes(8, "big"), msgpack.packb([time.time(), events, 0])]

    stored = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
              "token_ids": [1, 2, 3, 4], "block_size": 2}
    try:
        deadline = time.monotonic() + 10
        while idx.stats("10.0.0.7:8000").batches == 0:  # slow joiner: resend the first batch until seen
            assert time.monotonic() < deadline
            await send(batch([]))
            await asyncio.sleep(0.05)
        hostile = [
            [b"junk"],  # not three frames
            [b"", b"\x00" * 8, b"\xc1\xc1 not msgpack"],
            batch([{"type": "BlockRemoved", "block_hashes": list(range(1000, 1100))}]),  # never stored
            batch([{"type": "BlockStored", "block_hashes": [99], "parent_block_hash": 424242,  # unknown parent
                    "token_ids": [5, 6], "block_size": 2}]),
            batch([{"type": "BlockStored", "block_hashes": list(range(MAX_HASHES_PER_EVENT + 1)),
                    "parent_block_hash": None, "token_ids": [], "block_size": 2}]),  # absurd count
            batch([{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                    "token_ids": [1] * 9, "block_size": 2}]),  # tokens do not match the count
            batch([{"type": "BlockStored", "block_hashes": [8], "parent_block_hash": None,
                    "token_ids": [1, 2**40], "block_size": 2}]),  # token id out of u32
            batch([stored]),  # and finally one honest event
        ]
        for frames in hostile:
            await send(frames)
        while idx.blocks_indexed("10.0.0.7:8000") == 0:
            assert time.monotonic() < deadline, idx.snapshot()
            await asyncio.sleep(0.02)
        s = idx.stats("10.0.0.7:8000")
        assert s.garbage_frames == 1 and s.garbage_batches == 1
        assert s.removed_unknown == 100 and s.skipped_unknown_parent == 1
        assert s.garbage_events == 2 and s.skipped_length == 1
        assert idx.engine_hashes("10.0.0.7:8000") == {11, 12}
        assert idx.overlap([1, 2, 3, 4, 0]) == {"10.0.0.7:8000": 2}
        assert idx.workers() == ["10.0.0.7:8000"]
    finally:
        await mgr.close()
        pub.close(0)
        ctx.term()
