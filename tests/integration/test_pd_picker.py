"""A disaggregated pool through a real Envoy: the decode worker is the destination, the prefill worker is named in
`x-prefiller-host-port` (set only by the picker), short prompts stay local, and no path leaves a booking behind.

The decode workers are header-recording upstreams (tests/harness.EchoUpstream): what the decode-side sidecar
would receive. The prefill workers are real `trtllm-mock` processes publishing KV events, so the prefill choice
by KV overlap runs on the picker's real index; the renderer is the mock's.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path

import pytest
from aiohttp import web

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.dev import envoy_config, procs
from epp_extproc.gaie import DEST_HEADER, PREFILLER_HEADER
from tests.gateway_client import request
from tests.harness import BackgroundLoop, EchoUpstream, EnvoyProcess, Seen
from tests.stack import MockProc
from tests.waiting import until

LONG = "tell me a long story about the sea " * 30  # ~200 tokens: well past the threshold of 16
SHORT = "hi"


class StreamingDecode(EchoUpstream):
    """A decode-side upstream that also streams: a `"stream": true` chat request gets one SSE chunk, then waits
    for `sse_release` (a client reset can land mid-answer)."""

    prefiller_copies: list[list[str]] | None = None  # every copy of the header, per POST received

    async def _handle(self, req: web.Request) -> web.StreamResponse:
        body = await req.read()
        if req.method == "POST":
            if self.prefiller_copies is None:
                self.prefiller_copies = []
            self.prefiller_copies.append(req.headers.getall(PREFILLER_HEADER, []))
        if req.method != "POST" or b'"stream": true' not in body:
            return await super()._handle(_Replay(req, body))  # type: ignore[arg-type]
        self.seen.append(Seen(req.method, req.path_qs, dict(req.headers), body))
        resp = web.StreamResponse(headers={"x-upstream-name": self.name, "content-type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        assert self.sse_release is not None
        await asyncio.wait_for(self.sse_release.wait(), 20)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class _Replay:
    """The request with its body already read, for the parent handler."""

    def __init__(self, req: web.Request, body: bytes) -> None:
        self._req, self._body = req, body
        self.method, self.path, self.path_qs, self.headers = req.method, req.path, req.path_qs, req.headers

    async def read(self) -> bytes:
        return self._body


class PdStack:
    def __init__(self, mode: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="epp-pd-"))
        self.bg = BackgroundLoop()
        self.decode = [StreamingDecode("d0"), StreamingDecode("d1")]
        self.prefill = [MockProc.of(procs.mock_worker(f"p{i}", self.dir)) for i in range(2)]
        self.renderer = MockProc.of(procs.mock_renderer(self.dir))
        self.app: PickerApp | None = None
        self.envoy: EnvoyProcess | None = None
        try:
            for p in [*self.prefill, self.renderer]:
                p.start()
            for u in self.decode:
                self.bg.run(u.start())
            spec = ",".join([f"{p.name}={p.address};kv=tcp://127.0.0.1:{p.kv_port};role=prefill"
                             for p in self.prefill] + [f"{u.name}={u.address};role=decode" for u in self.decode])
            cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                         endpoints=spec, tokenizer_protocol="trtllm-render", tokenizer_service_url=self.renderer.url,
                         endpoint_probe_interval_ms=0, worker_metrics_interval_ms=0)
            cfg.validate()
            self.app = PickerApp(cfg)
            self.bg.run(self.app.start())
            self.envoy = EnvoyProcess(envoy_config.EnvoyOptions(picker_port=self.app.grpc_port,
                                                                body_mode=mode)).start()
            until(lambda: all(self.picker_get("/debug/kv")["workers"].get(p.address, {}).get("batches", 0) > 0
                              for p in self.prefill), "the prefill workers' KV events", 10, 0.05)
        except BaseException:
            self.close()
            raise

    def chat(self, content: str, headers: dict[str, str] | list[tuple[str, str]] | None = None, **extra: object):
        body = {"model": "mock-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
        assert self.envoy is not None
        return request(self.envoy.url, body=json.dumps(body).encode(), headers=headers)

    def picker_get(self, path: str) -> dict:
        assert self.app is not None
        return request(f"http://127.0.0.1:{self.app.admin_port}", method="GET", path=path).json()

    def seen_by(self, reply) -> dict[str, str]:  # noqa: ANN001
        u = next(u for u in self.decode if u.name == reply.headers["x-upstream-name"])
        return {k.lower(): v for k, v in u.seen[-1].headers.items()}

    def loads(self) -> dict[str, tuple[int, float, float]]:
        return {e["name"]: (e["inflight"], e["prefill_blocks"], e["decode_blocks"])
                for e in self.picker_get("/debug/endpoints")["endpoints"]}

    def wait_no_booking(self) -> None:
        until(lambda: all(v == (0, 0.0, 0.0) for v in self.loads().values())
              and self.picker_get("/debug/endpoints")["inflight_total"] == 0,
              lambda: f"no booking left: {self.loads()}", 10, 0.02)

    def metric(self, name: str, labels: str) -> float:
        assert self.app is not None
        text = request(f"http://127.0.0.1:{self.app.metrics_port}", method="GET", path="/metrics").body.decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and labels in line)

    def close(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        if self.app is not None:
            self.bg.run(self.app.stop())
        for u in self.decode:
            self.bg.run(u.stop())
        for p in [*self.prefill, self.renderer]:
            p.stop()
        self.bg.close()


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def pd(request):  # noqa: ANN001, ANN201
    s = PdStack(request.param)
    yield s
    s.close()


def test_the_decode_worker_is_the_destination_and_the_prefill_worker_travels_in_the_header(pd: PdStack) -> None:
    r = pd.chat(LONG)
    assert r.status == 200
    seen = pd.seen_by(r)
    decode = next(u for u in pd.decode if u.name == r.headers["x-upstream-name"])
    assert seen[DEST_HEADER] == decode.address
    assert seen[PREFILLER_HEADER] in {p.address for p in pd.prefill}
    pd.wait_no_booking()


def test_the_prefill_worker_holding_the_prompt_s_blocks_is_chosen(pd: PdStack) -> None:
    content = "a prompt that only the second prefill worker has seen " * 20
    pd.prefill[1].post("/v1/chat/completions", {"model": "mock-model", "max_tokens": 1,
                                                "messages": [{"role": "user", "content": content}]})
    until(lambda: pd.picker_get("/debug/kv")["workers"][pd.prefill[1].address]["blocks_indexed"] > 0,
          "the index to learn the second prefill worker's blocks", 10, 0.05)
    for _ in range(3):
        r = pd.chat(content)
        assert r.status == 200 and pd.seen_by(r)[PREFILLER_HEADER] == pd.prefill[1].address
    pd.wait_no_booking()


def test_a_spoofed_prefiller_header_is_replaced_when_the_picker_disaggregates(pd: PdStack) -> None:
    r = pd.chat(LONG, headers=[(PREFILLER_HEADER, "10.66.66.66:1"), (PREFILLER_HEADER, "10.66.66.67:1")])
    assert r.status == 200
    decode = next(u for u in pd.decode if u.name == r.headers["x-upstream-name"])
    assert decode.prefiller_copies is not None
    [value] = decode.prefiller_copies[-1]  # one copy, the picker's
    assert value in {p.address for p in pd.prefill}
    pd.wait_no_booking()


def test_a_spoofed_prefiller_header_is_removed_when_the_prompt_stays_local(pd: PdStack) -> None:
    r = pd.chat(SHORT, headers=[(PREFILLER_HEADER, "10.66.66.66:1"), (PREFILLER_HEADER.upper(), "10.66.66.67:1")])
    assert r.status == 200
    decode = next(u for u in pd.decode if u.name == r.headers["x-upstream-name"])
    assert decode.prefiller_copies is not None and decode.prefiller_copies[-1] == []
    pd.wait_no_booking()


def test_short_prompts_are_prefilled_on_the_decode_worker(pd: PdStack) -> None:
    before = pd.metric("epp_pd_decisions_total", 'path="local_prefill",reason="short_uncached_suffix"')
    r = pd.chat(SHORT)
    assert r.status == 200 and PREFILLER_HEADER not in pd.seen_by(r)
    assert pd.metric("epp_pd_decisions_total",
                     'path="local_prefill",reason="short_uncached_suffix"') == before + 1


def test_prefill_workers_never_receive_a_request_through_the_gateway(pd: PdStack) -> None:
    names = {pd.chat(c).headers.get("x-upstream-name") for c in (LONG, SHORT, LONG + "x")}
    assert names <= {u.name for u in pd.decode}


def test_debug_endpoints_show_roles(pd: PdStack) -> None:
    roles = {e["name"]: e["role"] for e in pd.picker_get("/debug/endpoints")["endpoints"]}
    assert roles == {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    assert pd.metric("epp_endpoints_by_role", 'role="prefill"') == 2


def test_a_decode_worker_that_is_down_leaves_no_booking_behind(pd: PdStack) -> None:
    down = pd.decode[0]
    pd.bg.run(down.stop())
    try:
        statuses = [pd.chat(LONG).status for _ in range(30)]
        assert 503 in statuses  # Envoy could not connect to the decode worker the picker named
        pd.wait_no_booking()
    finally:
        pd.bg.run(down.start())


def test_a_client_reset_while_the_answer_streams_leaves_no_booking_behind(pd: PdStack) -> None:
    assert pd.envoy is not None
    release = [u.sse_release for u in pd.decode]
    port = int(pd.envoy.url.rsplit(":", 1)[1])
    body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": LONG}],
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    first = s.recv(4096)  # the first chunk is through: prefill leg over, decode leg holding
    assert b"200" in first.split(b"\r\n", 1)[0]
    # the first chunk ended the context phase: the prefill leg is gone, the decode leg holds until the end
    until(lambda: [k for k, v in pd.loads().items() if v[0]] in (["d0"], ["d1"]),
          lambda: f"only the decode leg left: {pd.loads()}", 10, 0.02)
    streamed = [u.seen[-1] for u in pd.decode if u.seen and b'"stream": true' in u.seen[-1].body]
    assert streamed and PREFILLER_HEADER.lower() in {k.lower() for k in streamed[0].headers}  # it was a pair
    s.close()  # the client goes away mid-answer
    pd.wait_no_booking()
    for ev in release:
        assert ev is not None
        pd.bg.loop.call_soon_threadsafe(ev.set)
    time.sleep(0.05)
    for ev in release:
        pd.bg.loop.call_soon_threadsafe(ev.clear)


def test_debug_score_shows_the_pair_and_the_decider_s_reason(pd: PdStack) -> None:
    assert pd.app is not None
    url = f"http://127.0.0.1:{pd.app.admin_port}"
    for content, path, reason in ((LONG, "disaggregated", "long_uncached_suffix"),
                                  (SHORT, "local_prefill", "short_uncached_suffix")):
        body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": content}]}).encode()
        s = request(url, path="/debug/score", body=body).json()
        assert (s["pd"]["path"], s["pd"]["reason"], s["pd"]["decode"]) == (path, reason, s["pick"])
        assert s["pick"] in {u.address for u in pd.decode}
        assert (s["pd"]["prefill"] in {p.address for p in pd.prefill}) == (path == "disaggregated")
