"""Lean response mode through a real Envoy: no response chunk crosses the picker's main stream.

The end of the main stream frees the booking (after the last byte), an observability-mode filter ends the
prefill at the first chunk, and Envoy's gRPC access log brings the usage (captured by the Lua filter) and
the response flags. A scripted upstream controls exactly how the answer is cut into chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.dev import envoy_config
from tests.gateway_client import request
from tests.harness import BackgroundLoop, EnvoyProcess
from tests.waiting import until

pytestmark = pytest.mark.transport  # also run on --extproc-transport grpcio by `make test`

USAGE = {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103,
         "prompt_tokens_details": {"cached_tokens": 64}}


class ScriptedUpstream:
    """Answers each path with a scripted sequence of writes; `gate` holds the stream mid-way."""

    def __init__(self) -> None:
        self.port = 0
        self.gate: asyncio.Event | None = None
        self.runner: web.AppRunner | None = None

    async def handle(self, req: web.Request) -> web.StreamResponse:
        await req.read()
        sse = req.path.endswith("/sse")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream" if sse else "application/json"})
        await resp.prepare(req)
        usage = json.dumps({"usage": USAGE}).encode()
        if req.path.startswith("/v1/split-usage"):  # the usage object cut in two chunks
            await resp.write(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
            await asyncio.sleep(0.05)
            await resp.write(b"data: " + usage[:25])
            await asyncio.sleep(0.05)
            await resp.write(usage[25:] + b"\n\ndata: [DONE]\n\n")
        elif req.path.startswith("/v1/unary-parts"):  # a JSON answer in three chunks
            doc = json.dumps({"choices": [{"text": "x" * 3000}], "usage": USAGE}).encode()
            for i in range(3):
                await resp.write(doc[i * len(doc) // 3:(i + 1) * len(doc) // 3])
                await asyncio.sleep(0.03)
        elif req.path.startswith("/v1/held"):  # first chunk, then wait for the test, then the rest
            await resp.write(b'data: {"choices":[{"delta":{"content":"first"}}]}\n\n')
            assert self.gate is not None
            await asyncio.wait_for(self.gate.wait(), 20)
            await resp.write(b"data: " + usage + b"\n\ndata: [DONE]\n\n")
        elif req.path.startswith("/v1/die"):  # the worker dies mid-stream
            await resp.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
            await asyncio.sleep(0.05)
            assert req.transport is not None
            req.transport.abort()
            return resp
        await resp.write_eof()
        return resp

    async def start(self) -> None:
        self.gate = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


class Lean:
    def __init__(self, **config: Any) -> None:
        self.bg = BackgroundLoop()
        self.up = ScriptedUpstream()
        self.bg.run(self.up.start())
        self.app = PickerApp(Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                                    secure_serving=False, endpoint_probe_interval_ms=0,
                                    endpoints=f"w=127.0.0.1:{self.up.port}", **config))
        self.kinds: list[str] = []  # every message kind the picker's ext_proc streams received
        self._tap(self.app.servicer)
        self.bg.run(self.app.start())
        opts = envoy_config.EnvoyOptions(picker_port=self.app.grpc_port, picker_tls=False,
                                         picker_health_check=False, access_log_flush_ms=50)
        assert opts.response_mode == "lean"  # what every generated config uses
        self.envoy = EnvoyProcess(opts).start()

    def _tap(self, servicer: Any) -> None:
        inner = servicer.Process

        async def process(requests: Any, context: Any) -> Any:
            async def tapped() -> Any:
                async for r in requests:
                    self.kinds.append(r.WhichOneof("request"))
                    yield r

            async for resp in inner(tapped(), context):
                yield resp

        servicer.Process = process  # before start(): the gRPC server registers the method then

    def post(self, path: str, timeout: float = 20) -> bytes:
        r = request(self.envoy.url, path=path, body=b'{"model":"m"}', timeout=timeout)
        assert r.status == 200, r.body
        return r.body

    def signal(self, name: str) -> float:
        return self.app.metrics.lean_signals.labels(name)._value.get()

    def signals(self) -> dict[str, float]:
        """Every lean signal counted so far (what a failed wait shows)."""
        return {m.labels["signal"]: m.value for metric in self.app.metrics.lean_signals.collect()
                for m in metric.samples if m.name.endswith("_total")}

    def flag(self, name: str) -> float:
        return self.app.metrics.response_flags.labels(name)._value.get()

    def cached_count(self) -> float:
        return self.app.metrics.usage_observed.labels("access_log")._value.get()

    def settled(self) -> bool:
        """Every request so far is fully counted: its stream ended (no booking left) and its access-log entry
        was matched (nothing parked or held early). Read on the picker's loop, so never between the two halves
        of a stream's end (park, then free) or of an entry's match (take, then count)."""
        async def check() -> bool:
            return self.app.load.total_inflight() == 0 and len(self.app.picker.lean.late_usage) == 0

        return self.bg.run(check())

    def settle(self, what: str = "the earlier tests' requests to be counted") -> None:
        """Before a test counts its own request's usage: an earlier request's entry (Envoy ships the access log
        every `access_log_flush_ms`, after the client has its answer) must not land in the count."""
        until(self.settled, lambda: f"{what}; lean signals {self.signals()}")

    def close(self) -> None:
        self.envoy.stop()
        self.bg.run(self.app.stop())
        self.bg.run(self.up.stop())
        self.bg.close()


@pytest.fixture(scope="module")
def lean():
    s = Lean()
    yield s
    s.close()


def test_the_generated_config_keeps_response_bodies_off_the_pickers_stream() -> None:
    doc = envoy_config.to_dict(envoy_config.EnvoyOptions())
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", envoy_config.OBSERVER_FILTER, envoy_config.USAGE_FILTER,
                     "envoy.filters.http.router"]
    main = hcm["http_filters"][0]["typed_config"]["processing_mode"]
    assert main.get("response_body_mode", "NONE") == "NONE"  # proto JSON omits the enum's zero value
    assert main["response_trailer_mode"] == "SEND"
    observer = hcm["http_filters"][1]["typed_config"]  # wrapped in a matcher: it runs for SSE answers only
    assert observer["extension_config"]["typed_config"]["observability_mode"] is True
    skip = observer["xds_matcher"]["matcher_list"]["matchers"][0]
    assert skip["on_match"]["action"]["typed_config"]["@type"].endswith("SkipFilter")
    single = skip["predicate"]["not_matcher"]["single_predicate"]
    assert single["input"]["typed_config"]["header_name"] == "content-type"
    assert single["value_match"] == {"prefix": "text/event-stream", "ignore_case": True}
    assert hcm["access_log"][0]["name"] == "envoy.access_loggers.http_grpc"


def test_the_booking_lives_until_the_last_byte_and_prefill_ends_at_the_first_chunk(lean: Lean) -> None:
    lean.up.gate = asyncio.Event()  # a fresh gate, set from the loop thread below
    result: dict[str, bytes] = {}

    def client() -> None:
        result["body"] = lean.post("/v1/held/sse")

    import threading

    t = threading.Thread(target=client)
    t.start()
    until(lambda: lean.app.load.total_inflight() == 1, "the booking")
    until(lambda: all(ld.prefill_blocks == 0 for ld in lean.app.load.loads().values()),
          "the first chunk to end the prefill booking")
    time.sleep(0.3)
    assert lean.app.load.total_inflight() == 1, "freed before the answer ended"
    lean.bg.loop.call_soon_threadsafe(lean.up.gate.set)
    t.join(20)
    assert result["body"].endswith(b"data: [DONE]\n\n")
    until(lambda: lean.app.load.total_inflight() == 0, "the booking to be freed at the end")


def test_a_lean_request_sends_the_picker_nothing_of_its_response(lean: Lean) -> None:
    """Request headers and body in, the decision out; the stream's end is the only response signal."""
    lean.kinds.clear()
    lean.post("/v1/unary-parts")
    until(lambda: lean.app.load.total_inflight() == 0, "the booking freed at the stream's end")
    assert "request_headers" in lean.kinds and "request_body" in lean.kinds
    assert [k for k in lean.kinds if k.startswith("response_")] == []


def first_chunks(lean: Lean) -> float:
    return lean.signal("first_chunk") + lean.signal("first_chunk_unknown")


def test_only_sse_answers_open_the_first_chunk_observer_stream(lean: Lean) -> None:
    """A unary answer is complete at its first chunk: the main stream's end says it, no second stream."""
    lean.settle()
    before, logged = first_chunks(lean), lean.cached_count()
    lean.post("/v1/unary-parts")
    until(lambda: lean.cached_count() == logged + 1, "the unary request's access log entry")
    until(lambda: lean.app.load.total_inflight() == 0, "the unary booking freed")
    assert first_chunks(lean) == before
    lean.post("/v1/split-usage/sse")
    until(lambda: first_chunks(lean) == before + 1, "the SSE answer's first-chunk signal")


def test_usage_split_across_two_chunks_reaches_the_metrics(lean: Lean) -> None:
    # The test before this one ends as soon as its own split-usage answer's first chunk is signalled, before
    # that request's stream end and access-log entry are counted: without settling, that count could land
    # after `before` and a stall of this thread let both land before the wait's first look (+2, never +1).
    lean.settle()
    before, cached = lean.cached_count(), lean.app.metrics.cached_tokens.labels("m")._sum.get()
    lean.post("/v1/split-usage/sse")
    until(lambda: lean.cached_count() == before + 1, "the usage from the access log")
    assert lean.app.metrics.cached_tokens.labels("m")._sum.get() == cached + 64  # this request's usage


def test_a_unary_answer_in_several_chunks_gives_its_usage(lean: Lean) -> None:
    lean.settle()
    before = lean.cached_count()
    body = lean.post("/v1/unary-parts")
    assert json.loads(body)["usage"] == USAGE
    until(lambda: lean.cached_count() == before + 1,
          lambda: f"the unary usage from the access log; lean signals {lean.signals()}")


def test_an_access_log_entry_that_comes_before_its_stream_ends_still_gives_the_usage(lean: Lean) -> None:
    """Envoy writes the access log before it closes the filters' streams, and a full buffer ships the entry at
    once: it can reach the picker before the main stream's end does."""
    lean.settle()
    before, early = lean.cached_count(), lean.signal("access_log_early")
    lean.up.gate = asyncio.Event()
    t = threading.Thread(target=lambda: lean.post("/v1/held/sse"))
    t.start()
    until(lambda: lean.app.load.total_inflight() == 1, "the booking")
    booking = lean.app.load.bookings()[0].id

    async def entry_first() -> None:
        lean.app.picker.access_logged(booking, b'"usage":' + json.dumps(USAGE).encode() + b"}", [])

    lean.bg.run(entry_first())
    assert lean.signal("access_log_early") == early + 1 and lean.cached_count() == before
    lean.bg.loop.call_soon_threadsafe(lean.up.gate.set)
    t.join(20)
    until(lambda: lean.cached_count() == before + 1, "the usage counted when the stream ended")
    # Envoy's own entry for it comes later and is counted once only
    until(lambda: lean.signal("access_log_unmatched") >= 1 and len(lean.app.picker.lean.late_usage) == 0,
          lambda: f"Envoy's own entry; lean signals {lean.signals()}")
    assert lean.cached_count() == before + 1


def test_a_client_that_disconnects_mid_stream_frees_the_booking_and_is_reported(lean: Lean) -> None:
    lean.up.gate = asyncio.Event()
    host, port = lean.envoy.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/held/sse", body=b'{"model":"m"}', headers={"content-type": "application/json"})
    resp = conn.getresponse()
    resp.read1(10)  # the first chunk arrived
    until(lambda: lean.app.load.total_inflight() == 1, "the booking")
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    until(lambda: lean.app.load.total_inflight() == 0, "the booking freed after the client left")
    until(lambda: lean.flag("downstream_connection_termination") + lean.flag("downstream_remote_reset") >= 1,
          "the access log to report the client's disconnect")
    lean.bg.loop.call_soon_threadsafe(lean.up.gate.set)


def test_a_worker_dying_mid_stream_frees_the_booking_and_is_reported(lean: Lean) -> None:
    host, port = lean.envoy.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/die/sse", body=b'{"model":"m"}', headers={"content-type": "application/json"})
    resp = conn.getresponse()
    with pytest.raises((http.client.IncompleteRead, ConnectionError)):
        resp.read()
    conn.close()
    until(lambda: lean.app.load.total_inflight() == 0, "the booking freed after the worker died")
    # a chunked HTTP/1.1 answer cut mid-body is Envoy's upstream protocol error (UPE)
    until(lambda: sum(lean.flag(f) for f in ("upstream_remote_reset", "upstream_connection_termination",
                                               "upstream_protocol_error")) >= 1,
          "the access log to report the upstream's death")


def test_no_request_leaves_pending_usage_or_bookings_behind(lean: Lean) -> None:
    for _ in range(5):
        lean.post("/v1/unary-parts")
    lean.settle("every parked usage matched by its access-log entry")


@contextlib.contextmanager
def _held_lean_answer(keepalive_s: float) -> Iterator[tuple[Lean, dict[str, Any], threading.Thread]]:
    """A picker whose h2 server pings after `keepalive_s` of silence (and gives up 0.3 s later), and one lean SSE
    answer held open by the upstream, yielded once its booking is in place."""
    lean = Lean(extproc_keepalive_s=keepalive_s)
    try:
        lean.app._grpc.keepalive_timeout_s = 0.3
        lean.up.gate = asyncio.Event()
        out: dict[str, Any] = {}

        def client() -> None:
            try:
                out["body"] = request(lean.envoy.url, path="/v1/held/sse", body=b'{"model":"m"}', timeout=30).body
            except Exception as e:  # noqa: BLE001 - the frozen-gateway case expects a broken answer
                out["error"] = e

        t = threading.Thread(target=client)
        t.start()
        until(lambda: lean.app.load.total_inflight() == 1, "the booking")
        yield lean, out, t
    finally:
        lean.close()


def test_envoy_answers_the_keepalive_pings_of_a_long_silent_lean_stream(caplog) -> None:  # noqa: ANN001
    """A lean stream is silent for the whole answer: 15 keepalive periods of it must not cost the booking."""
    with _held_lean_answer(0.1) as (lean, out, t):
        time.sleep(1.5)
        assert lean.app.load.total_inflight() == 1 and "not even the answer to a PING" not in caplog.text
        lean.bg.loop.call_soon_threadsafe(lean.up.gate.set)
        t.join(20)
        assert out.get("body", b"").endswith(b"data: [DONE]\n\n"), out
        until(lambda: lean.app.load.total_inflight() == 0, "the booking freed at the end")


def test_a_frozen_gateway_loses_its_connection_and_the_booking_is_freed(caplog) -> None:  # noqa: ANN001
    """SIGSTOP: the kernel still acknowledges every byte, as for a host whose gateway hangs, but nothing answers
    the picker's PING. Without keepalive the booking stayed until the process came back, or forever."""
    from tests.conftest import TRANSPORT

    if TRANSPORT == "grpcio":
        pytest.skip("--extproc-keepalive-s is the h2 server's; grpcio's server is run without keepalive")
    with _held_lean_answer(0.2) as (lean, _, t):
        envoy = lean.envoy.proc
        assert envoy is not None
        envoy.send_signal(signal.SIGSTOP)
        try:
            until(lambda: lean.app.load.total_inflight() == 0, "the booking freed while Envoy is frozen", 5)
        finally:
            envoy.send_signal(signal.SIGCONT)
        assert "not even the answer to a PING" in caplog.text
        lean.bg.loop.call_soon_threadsafe(lean.up.gate.set)
        t.join(20)
        assert lean.post("/v1/unary-parts")  # Envoy connects again and routes the next request
        until(lambda: lean.app.load.total_inflight() == 0, "no booking left")


def test_hundreds_of_requests_a_second_keep_the_pickers_connection(lean: Lean) -> None:
    """Envoy ends each request's ext_proc stream with a reset soon after the picker answered it: that is not
    a rapid-reset attack, and the connection must survive well past 500 streams a second (it did not, once:
    every request from the 500th on got Envoy's 500)."""
    from concurrent.futures import ThreadPoolExecutor

    from h2grpc import H2GrpcServer

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(lambda _: lean.post("/v1/unary-parts"), range(700)))
    server = lean.app._grpc
    if isinstance(server, H2GrpcServer):
        assert server.goaways == {}
