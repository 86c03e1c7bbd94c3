"""Unfinished request bodies against the real picker process, measured in its resident memory.

The picker's body bound (`--max-buffered-body-bytes`) is a counter in the exchange (`core/admission.py`) and,
one layer down, in the ext_proc transport (messages still arriving); what the process holds is VmRSS, which
also shows the copies between them, a buffer grown by reallocation and the allocator's holes. The picker runs
as `epp-extproc` in its own process (plaintext h2c, no renderer, one endpoint that is never asked: an
unfinished body never reaches a decision); the client speaks HTTP/2 frames itself (tests/h2/partial_rss.py's
`Attack`) so that it can leave a gRPC message unfinished, which no gRPC client can.

Each call opens one ext_proc stream and sends request_headers, then its body of `mb` MB as ProcessingRequest
request_body messages with end_of_stream false, in one of the two shapes Envoy uses:

- `chunks`: messages of `chunk` bytes each (FULL_DUPLEX_STREAMED, Envoy's chunks as the client's bytes
  arrive); every message is whole, the body never ends: the exchange holds it.
- `whole`: one message with the whole body, all of it sent but its last byte (BUFFERED: Envoy sends the
  buffered body as one message): the transport holds it.
- `both`: a whole message of half the body, then the other half as an unfinished message: both layers hold.

`python -m tests.integration.body_rss [--transport h2|grpcio] [--shape chunks] [--calls 10] [--mb 30]`
prints the figures of one attack (baseline RSS, growth while held, growth after the calls are cancelled).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import hpack
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp_extproc.dev import procs
from tests.h2.partial_rss import Attack

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
_HEADERS = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", PROCESS),
                                   (":authority", "x"), ("content-type", "application/grpc"),
                                   ("te", "trailers")])


def _grpc(msg: pb.ProcessingRequest) -> bytes:
    data = msg.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


def headers_message(path: str = "/v1/chat/completions") -> bytes:
    hs = [(":method", "POST"), (":path", path), (":authority", "gw"), ("content-type", "application/json")]
    return _grpc(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]), end_of_stream=False)))


def body_message(size: int) -> bytes:
    return _grpc(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * size, end_of_stream=False)))


def stream_bytes(shape: str, size: int, chunk: int) -> tuple[bytes, int]:
    """What one call sends, and how many bytes of its end are withheld (its last message unfinished)."""
    head = headers_message()
    if shape == "chunks":
        n, rest = divmod(size, chunk)
        one = body_message(chunk)
        return head + one * n + (body_message(rest) if rest else b""), 0
    if shape == "whole":
        return head + body_message(size), 1
    if shape == "both":
        return head + body_message(size // 2) + body_message(size - size // 2), 1
    raise ValueError(shape)


class ExtProcAttack(Attack):
    """`Attack` on the picker's ext_proc method: each call sends the same bytes, frame by frame, interleaved."""

    async def send_streams(self, calls: int, data: bytes, short: int = 0, timeout: float = 180.0) -> list[int]:
        """Open `calls` streams and send `data` on each but its last `short` bytes, a frame to each stream in
        turn, honouring the server's windows. A stream the server ends or resets gets no more."""
        return await self.send_interleaved(_HEADERS, memoryview(data)[:len(data) - short], calls, timeout)


def start_picker(workdir: Path, transport: str, extra: tuple[str, ...] = ()) -> procs.Proc:
    """The real picker, plaintext, with one endpoint nothing is sent to (unfinished bodies are never decided)."""
    p = procs.picker(workdir, endpoints="w0=127.0.0.1:9", args=[
        "--secure-serving=false", "--extproc-transport", transport, "--endpoint-probe-interval-ms", "0",
        "--log-level", "WARNING", *extra])
    # the code of this checkout, not whichever one the virtualenv's editable install points at
    p.env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    p.start(timeout=60)
    return p


def steady_rss(p: procs.Proc) -> int:
    """The largest of a few readings, so a page the allocator is still returning does not flatter it."""
    readings = []
    for _ in range(3):
        readings.append(p.rss_bytes())
        time.sleep(0.05)
    return max(readings)


async def settled_rss(p: procs.Proc, timeout: float = 10.0, window: int = 5) -> int:
    """RSS once the picker has finished releasing what cancelled calls held: readings every 0.1 s until the
    last `window` of them lie within 1 MiB of each other (their largest), or the largest of the last ones at
    the deadline. A busy machine delays the handlers' clean-up after the PING is answered; a fixed sleep read
    that delay as memory kept."""
    readings: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        readings.append(p.rss_bytes())
        last = readings[-window:]
        if len(last) == window and max(last) - min(last) <= 1 << 20 or time.monotonic() > deadline:
            return max(last)
        await asyncio.sleep(0.1)


async def attack(p: procs.Proc, shape: str, calls: int, size: int, chunk: int = 64 << 10) -> dict[str, float]:
    """One round on a running picker: RSS (bytes) before, while the calls are held, and after they are cancelled;
    `peak` is the largest reading seen while sending, `ended` how many calls the picker ended on its own."""
    data, short = stream_bytes(shape, size, chunk)
    base = steady_rss(p)
    peak = base
    a = ExtProcAttack(p.port or 0)
    await a.open()
    done = False

    async def watch() -> None:
        nonlocal peak
        while not done:
            peak = max(peak, p.rss_bytes())
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        sids = await a.send_streams(calls, data, short)
        await a.ping()
        await asyncio.sleep(0.3)  # the picker's handlers have run what the frames woke (ping: the reads)
        await a.ping()
        held = steady_rss(p)
        done = True
        await watcher
        peak = max(peak, held)
        ended = sum(1 for s in sids if s in a.statuses or s in a.reset)
        for sid in sids:
            a.cancel(sid)
        await a.ping()
        after = await settled_rss(p)
    finally:
        done = True
        await a.close()
    return {"base": base, "held": held, "peak": peak, "after": after, "ended": ended,
            "sent": calls * size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", choices=("h2", "grpcio"), default="h2")
    ap.add_argument("--shape", choices=("chunks", "whole", "both"), default="chunks")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--mb", type=float, default=30)
    ap.add_argument("--chunk-kb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("picker_args", nargs="*", help="more picker flags (after --)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        p = start_picker(Path(d), a.transport, tuple(a.picker_args))
        try:
            time.sleep(0.5)
            for r in range(a.rounds):
                f = asyncio.run(attack(p, a.shape, a.calls, int(a.mb * 1e6), a.chunk_kb << 10))
                print(f"{a.transport} {a.shape} round {r + 1}: base {f['base'] / 1e6:.0f} MB, held "
                      f"+{(f['held'] - f['base']) / 1e6:.0f} MB, peak +{(f['peak'] - f['base']) / 1e6:.0f} MB, "
                      f"after cancel +{(f['after'] - f['base']) / 1e6:.0f} MB; sent {f['sent'] / 1e6:.0f} MB, "
                      f"{f['ended']:.0f} calls ended by the picker", file=sys.stdout, flush=True)
        finally:
            p.stop()


if __name__ == "__main__":
    main()
