"""What one echoed response chunk costs a Python gRPC server, against what it costs the picker.

In GAIE's echo mode every response chunk is one ext_proc message in and one out. grpcio's asyncio stack has
a floor per message pair (the poller thread, a completion-queue event and a loop wake-up each way, protobuf
in and out) that no servicer written on it can go under. This measures, in the same run and with the same
client, (a) a trivial servicer (on the picker's event loop) that echoes each chunk and does nothing else, and
(b) the real picker (its own process, a decided request first, then the chunks), so the picker's own share
per chunk is (b) - (a); both on each ext_proc transport (`--extproc-transport`): grpcio's asyncio server, and
the picker's own h2 server (`epp_extproc/envoy/h2server.py`). Both are driven directly over gRPC (no Envoy), with 8 concurrent streams; CPU is the server
process's user + system time from /proc.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench import harness as H

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.BodySendMode.Value("FULL_DUPLEX_STREAMED")
CHUNK = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"mock-model",'
         b'"choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}\n\n')


def _echo(body: pb.HttpBody) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=body.body, end_of_stream=body.end_of_stream)))))


class TrivialEcho(pb_grpc.ExternalProcessorServicer):
    """The floor: answers request messages with empty responses and echoes response chunks, nothing else."""

    async def Process(self, requests, context):  # noqa: N802, ANN001, ANN201
        async for req in requests:
            kind = req.WhichOneof("request")
            if kind == "response_body":
                yield _echo(req.response_body)
            elif kind == "request_body":
                if req.request_body.end_of_stream:
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                            body=req.request_body.body, end_of_stream=True)))))
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def serve_servicer(servicer_cls: type, port: int, ready: Any, transport: str = "grpcio") -> None:
    """A spawned process's main: `servicer_cls()` as the ext_proc service on `port`, on the picker's loop,
    served by grpcio's asyncio server or by the picker's own h2 server (`--extproc-transport`)."""
    async def main() -> None:
        if transport == "h2":
            from epp_extproc.envoy.h2server import H2GrpcServer

            h2 = H2GrpcServer(max_concurrent_rpcs=10_000)
            pb_grpc.add_ExternalProcessorServicer_to_server(servicer_cls(), h2)
            await h2.bind("127.0.0.1", port)
            await h2.start()
            ready.set()
            await asyncio.Event().wait()
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(servicer_cls(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    run_loop(main())


def floor(servicer_cls: type, transport: str, measure_it: Any) -> float:
    """`measure_it(port, cpu)` against a trivial servicer in its own spawned process."""
    port = H.free_port()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=serve_servicer, args=(servicer_cls, port, ready, transport), daemon=True)
    proc.start()
    try:
        if not ready.wait(20):
            raise RuntimeError(f"trivial {transport} servicer did not start")
        time.sleep(0.3)
        return measure_it(port, lambda: H.proc_cpu_seconds(proc.pid))
    finally:
        proc.terminate()
        proc.join(5)


def run_loop(main: Any) -> None:
    """A floor on the loop the picker itself runs on (`--event-loop auto`: uvloop when installed)."""
    from epp_extproc.cli import run

    async def wrapped() -> int:
        await main
        return 0

    run(wrapped(), "auto")


def _headers(pairs: list[tuple[str, str]], end: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]), end_of_stream=end)


async def _one_stream(stub: pb_grpc.ExternalProcessorStub, chunks: int) -> int:
    """One HTTP request as Envoy's FULL_DUPLEX_STREAMED ext_proc sends it; each chunk waits for its echo."""
    turn: asyncio.Queue[int] = asyncio.Queue()
    body = json.dumps({"model": "mock-model", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()

    async def messages():  # noqa: ANN202
        yield pb.ProcessingRequest(
            request_headers=_headers([(":method", "POST"), (":path", "/v1/chat/completions"),
                                      ("content-type", "application/json")]),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX, response_body_mode=FULL_DUPLEX))
        yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        await turn.get()
        yield pb.ProcessingRequest(response_headers=_headers([(":status", "200"), ("content-type", "text/event-stream")]))
        for _ in range(chunks):
            yield pb.ProcessingRequest(response_body=pb.HttpBody(body=CHUNK))
            await turn.get()
        yield pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))

    echoed = 0
    async for r in stub.Process(messages()):
        kind = r.WhichOneof("response")
        if kind == "request_body" and r.request_body.response.body_mutation.streamed_response.end_of_stream:
            turn.put_nowait(1)
        elif kind == "response_body":
            echoed += 1
            turn.put_nowait(1)
    return echoed


async def _drive(port: int, chunks: int, streams: int, concurrency: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        echoed = 0
        for _ in range(streams // concurrency):
            echoed += sum(await asyncio.gather(*[_one_stream(stub, chunks) for _ in range(concurrency)]))
        return echoed


def us_per_chunk(port: int, cpu: Any, chunks: int, streams: int, concurrency: int) -> tuple[float, int]:
    """CPU µs per extra chunk: streams of `chunks` chunks minus streams of 8, so the per-request part cancels."""
    asyncio.run(_drive(port, 8, concurrency, concurrency))  # warm-up
    c0 = cpu()
    asyncio.run(_drive(port, 8, streams, concurrency))
    c1 = cpu()
    echoed = asyncio.run(_drive(port, chunks, streams, concurrency))
    c2 = cpu()
    return ((c2 - c1) - (c1 - c0)) * 1e6 / (streams * (chunks - 8)), echoed


def measure(chunks: int = 1000, streams: int = 32, concurrency: int = 8) -> dict[str, Any]:
    """Per transport (`--extproc-transport`): the trivial servicer's floor and the picker, same client."""
    out: dict[str, Any] = {"chunks_per_stream": chunks, "streams": streams, "concurrency": concurrency}
    for transport in ("grpcio", "h2"):
        t: dict[str, Any] = {}
        t["trivial_us_per_chunk"] = floor(TrivialEcho, transport, lambda port, cpu: us_per_chunk(
            port, cpu, chunks, streams, concurrency)[0])
        with H.Stack() as st:
            w = H.mock_worker(st, "w0", kv=False)
            pk = H.picker(st, f"w0={w.address}", extra=[
                "--endpoint-probe-interval-ms", "0", "--worker-metrics-interval-ms", "0", "--secure-serving=false",
                "--extproc-transport", transport])
            time.sleep(0.5)
            t["picker_us_per_chunk"], t["picker_echoed_chunks"] = us_per_chunk(pk.port, pk.cpu_seconds, chunks,
                                                                               streams, concurrency)
        t["picker_own_us_per_chunk"] = t["picker_us_per_chunk"] - t["trivial_us_per_chunk"]
        out[transport] = t
    out["picker_h2_over_grpcio"] = out["h2"]["picker_us_per_chunk"] / out["grpcio"]["picker_us_per_chunk"]
    return out


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
