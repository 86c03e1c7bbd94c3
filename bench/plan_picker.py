"""An ext_proc server that routes each request to the worker a precomputed plan names (issue 28, item 2).

    python -m bench.plan_picker --port P --plan plan.json [--stats stats.json]

A benchmark tool, not the product: bench/clairvoyant.py places every request of a trace offline, knowing the
future; this server replays that placement through the same Envoy and mock workers the pickers are measured
on, so the clairvoyant figure becomes a *replayed* bound (TTFT, ITL and the engines' own cached tokens under
the mock's real batching and queueing) beside the offline one (a cached ratio from an idealised timing model).

Requests are matched to the plan by their prompt content: the key is a hash of the messages' text (what
AIPerf sends for a ``text_input`` row), so the match survives arrival jitter and reordering by the load
generator. Identical prompts (a trace may repeat one) take that prompt's plan entries in plan order. A request
the plan does not know is routed round-robin and counted (``unmatched``): a non-zero count means the replay
was not the plan's.

Wire: Envoy's ext_proc with the request body BUFFERED, response phases skipped (bench_trace configures it so);
the decision is the endpoint picker protocol's destination header plus its ``envoy.lb`` metadata, as the
product and the conformance suite's fake picker answer.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import signal
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

from epp_extproc.gaie import DEST_HEADER, LB_NAMESPACE


def prompt_key(texts: Iterable[str]) -> str:
    """The match key of one prompt: a hash of its messages' text, in order (NUL between messages)."""
    return hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:32]


def body_texts(body: bytes) -> list[str] | None:
    """The text of each message of an OpenAI chat body (string content, or its text parts), or a completion
    body's prompt; None for a body that is neither (it is routed round-robin and counted)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    msgs = doc.get("messages")
    if isinstance(msgs, list):
        out = []
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                out.append(c)
            elif isinstance(c, list):
                out.append("".join(p.get("text", "") for p in c if isinstance(p, dict)))
            else:
                out.append("")
        return out
    prompt = doc.get("prompt")
    return [prompt] if isinstance(prompt, str) else None


class Plan:
    """Plan entries keyed by prompt; each request takes the next unused entry of its prompt."""

    def __init__(self, workers: Sequence[str], entries: Iterable[tuple[str, int]]) -> None:
        if not workers:
            raise ValueError("a plan needs at least one worker")
        self.workers = list(workers)
        self._queues: dict[str, deque[int]] = {}
        for key, k in entries:
            if not 0 <= k < len(self.workers):
                raise ValueError(f"plan entry names worker {k}, only {len(self.workers)} known")
            self._queues.setdefault(key, deque()).append(k)
        self._turn = itertools.count()
        self.matched = 0
        self.unmatched = 0

    @classmethod
    def load(cls, path: Path) -> Plan:
        doc = json.loads(path.read_text())
        return cls(doc["workers"], ((e[0], int(e[1])) for e in doc["entries"]))

    def take(self, key: str | None) -> str:
        """The worker address for the next request with this key (round-robin when the plan has none left)."""
        q = self._queues.get(key) if key is not None else None
        if q:
            self.matched += 1
            return self.workers[q.popleft()]
        self.unmatched += 1
        return self.workers[next(self._turn) % len(self.workers)]

    def stats(self) -> dict[str, Any]:
        left = sum(len(q) for q in self._queues.values())
        return {"matched": self.matched, "unmatched": self.unmatched, "plan_entries_left": left}


def write_plan(path: Path, workers: Sequence[str], texts: Sequence[str], placement: Sequence[int]) -> Path:
    """The plan file for one replay: ``texts[i]`` (a single-message prompt) goes to ``workers[placement[i]]``;
    entries in arrival order (``texts`` in it), so identical prompts take them in that order."""
    entries = [[prompt_key([t]), k] for t, k in zip(texts, placement, strict=True)]
    path.write_text(json.dumps({"workers": list(workers), "entries": entries}))
    return path


def _servicer(plan: Plan) -> Any:
    """The ExternalProcessor servicer (imports the protocol stubs only when serving)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from google.protobuf import struct_pb2

    def routed(dest: str) -> Any:
        mutation = pb.HeaderMutation(remove_headers=[DEST_HEADER], set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DEST_HEADER, raw_value=dest.encode()))])
        resp = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            header_mutation=mutation, clear_route_cache=True)))
        md = struct_pb2.Struct()
        md.update({LB_NAMESPACE: {DEST_HEADER: dest}})
        resp.dynamic_metadata.CopyFrom(md)
        return resp

    class PlanServicer(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # noqa: N802
            body = bytearray()
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                elif kind == "request_body":
                    body += req.request_body.body
                    if req.request_body.end_of_stream:
                        texts = body_texts(bytes(body))
                        yield routed(plan.take(prompt_key(texts) if texts is not None else None))
                elif kind == "response_headers":
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                elif kind == "response_body":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    return PlanServicer(), pb_grpc.add_ExternalProcessorServicer_to_server


async def serve(port: int, plan: Plan, stats: Path | None) -> None:
    import grpc

    servicer, add = _servicer(plan)
    server = grpc.aio.server()
    add(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if stats is not None:
        stats.write_text(json.dumps(plan.stats()))
    await server.stop(2)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True, help="ext_proc port (plaintext h2c)")
    ap.add_argument("--plan", type=Path, required=True, help="plan JSON: {workers: [addr], entries: [[key, k]]}")
    ap.add_argument("--stats", type=Path, help="written on SIGTERM: matched / unmatched requests")
    a = ap.parse_args(argv)
    asyncio.run(serve(a.port, Plan.load(a.plan), a.stats))


if __name__ == "__main__":
    main()
