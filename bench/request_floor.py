"""What one routed request costs the picker's process, against what it costs any grpc.aio servicer.

Envoy opens one ext_proc stream per HTTP request. In lean mode an HTTP/1.1 request's stream carries the
request headers, the body and an empty end-of-body message in, the decision and the forwarded body out, then
ends. This drives that exact sequence over gRPC (no Envoy, so no Envoy noise on the 2 cores) at concurrency
32, in the same run, on each ext_proc transport (grpcio's asyncio server and the picker's own h2 server),
against (a) a trivial servicer on the same event loop as the picker that answers with a fixed endpoint and
does nothing else, and (b) the real picker with `trtllm-render` against the mock renderer
(one HTTP call per request) and two endpoints. (b) - (a) is the picker's own work; 1 s / (b) is what one
picker core carries. CPU is the server process's user + system time from /proc.

Also: the CPU of one render call in the picker's client (`adapters/http1.py` under `RenderClient`) against
aiohttp's client doing the same POST and read, same renderer, same run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench import harness as H
from bench.chat_bodies import make_bodies
from bench.echo_floor import _headers, floor

_Mode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX, NONE = _Mode.Value("FULL_DUPLEX_STREAMED"), _Mode.Value("NONE")


class TrivialRouter(pb_grpc.ExternalProcessorServicer):
    """The floor: routes every request to one fixed endpoint, echoing the body, and nothing else."""

    async def Process(self, requests, context):  # noqa: N802, ANN001, ANN201
        body = b""  # this stream's body (the picker forwards it too)
        async for req in requests:
            if req.WhichOneof("request") == "request_body" and req.request_body.end_of_stream:
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                    header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key="x-gateway-destination-endpoint",
                                                    raw_value=b"127.0.0.1:20000"))]),
                    clear_route_cache=True)))
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=body + req.request_body.body, end_of_stream=True)))))
            elif req.WhichOneof("request") == "request_body":
                body += req.request_body.body


async def _one(stub: pb_grpc.ExternalProcessorStub, body: bytes) -> None:
    done = asyncio.Event()

    async def messages():  # noqa: ANN202
        yield pb.ProcessingRequest(
            request_headers=_headers([(":method", "POST"), (":path", "/v1/chat/completions"),
                                      ("content-type", "application/json"), ("content-length", str(len(body)))]),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX, response_body_mode=NONE))
        yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body))
        yield pb.ProcessingRequest(request_body=pb.HttpBody(body=b"", end_of_stream=True))
        await done.wait()

    async for r in stub.Process(messages()):
        kind = r.WhichOneof("response")
        if kind == "immediate_response":
            raise RuntimeError(f"picker refused the request: {r.immediate_response.body[:200]!r}")
        if kind == "request_body" and r.request_body.response.body_mutation.streamed_response.end_of_stream:
            done.set()


async def _drive(port: int, make: Any, n: int, concurrency: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        left = iter(range(n))

        async def worker() -> None:
            for i in left:
                await _one(stub, make(i))

        await asyncio.gather(*[worker() for _ in range(concurrency)])


def us_per_request(port: int, cpu: Any, make: Any, n: int, concurrency: int) -> float:
    asyncio.run(_drive(port, make, max(n // 10, concurrency), concurrency))  # warm-up
    c0 = cpu()
    asyncio.run(_drive(port, make, n, concurrency))
    return (cpu() - c0) * 1e6 / n


async def _render_cpu(renderer_url: str, bodies: list[bytes], n: int, conc: int) -> dict[str, float]:
    import aiohttp

    from epp_extproc.adapters.render_client import CHAT_PATH, RenderClient
    from epp_extproc.metrics import PickerMetrics

    async def timed(call: Any) -> float:
        async def worker(k: int) -> None:
            for i in range(n // conc):
                await call(bodies[(k * 7 + i) % len(bodies)])
        await asyncio.gather(*[worker(k) for k in range(conc)])  # warm: connections open
        c0 = time.process_time()
        await asyncio.gather(*[worker(k) for k in range(conc)])
        return (time.process_time() - c0) * 1e6 / (n // conc * conc)

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=30),
                                    timeout=aiohttp.ClientTimeout(total=5))

    async def with_aiohttp(body: bytes) -> None:  # what RenderClient did before adapters/http1.py
        async with session.post(renderer_url + CHAT_PATH, data=body, headers={"content-type": "application/json"},
                                allow_redirects=False) as r:
            buf = bytearray()
            async for chunk in r.content.iter_chunked(65536):
                buf += chunk
            assert r.status == 200

    rc = RenderClient("trtllm-render", renderer_url, timeout_ms=5000, max_response_bytes=1 << 24,
                      metrics=PickerMetrics())

    async def with_picker_client(body: bytes) -> None:
        await rc.render("chat", body)

    out = {"aiohttp_us_per_call": await timed(with_aiohttp),
           "picker_render_client_us_per_call": await timed(with_picker_client)}
    await session.close()
    await rc.close()
    return out


def measure(quick: bool = False) -> dict[str, Any]:
    n = 300 if quick else 3000
    make = make_bodies(120)
    out: dict[str, Any] = {"requests": n, "concurrency": 32}
    for transport in ("grpcio", "h2"):
        t: dict[str, Any] = {"trivial_us_per_request": floor(TrivialRouter, transport, lambda port, cpu: (
            us_per_request(port, cpu, make, n, 32)))}
        with H.Stack() as st:
            renderer = H.mock_renderer(st)
            H.wait_port(renderer.port)
            pk = H.picker(st, "w0=127.0.0.1:20000,w1=127.0.0.1:20001", "trtllm-render", renderer,
                          extra=[*H.SIMULATED_WORKER_FLAGS, "--worker-metrics-interval-ms", "0",
                                 "--secure-serving=false", "--extproc-transport", transport])
            time.sleep(0.5)
            t["picker_us_per_request"] = us_per_request(pk.port, pk.cpu_seconds, make, n, 32)
            if transport == "h2":
                out["render_call"] = asyncio.run(_render_cpu(renderer.url, [make(i) for i in range(200)],
                                                             400 if quick else 4000, 16))
        t["picker_own_us_per_request"] = t["picker_us_per_request"] - t["trivial_us_per_request"]
        t["one_picker_core_rps"] = 1e6 / t["picker_us_per_request"]
        t["trivial_servicer_core_rps"] = 1e6 / t["trivial_us_per_request"]
        out[transport] = t
    out["picker_h2_over_grpcio"] = out["h2"]["picker_us_per_request"] / out["grpcio"]["picker_us_per_request"]
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=1))
