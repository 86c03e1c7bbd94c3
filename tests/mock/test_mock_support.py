"""Helpers for the trtllm_mock tests (no tests here): in-process workers, a raw SUB, a msgpack type walker.

KV events are decoded with plain msgpack on purpose, independently of kvindex: the point is to check the
bytes the mock publishes, not to agree with our own decoder.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from tests.netutil import free_port
from trtllm_mock import MockConfig, MockWorker

U64 = (1 << 64) - 1


@contextlib.asynccontextmanager
async def running_worker(**overrides: Any) -> AsyncIterator[MockWorker]:
    """A worker on free ports with test-friendly defaults (fast timings, no heartbeats unless asked)."""
    cfg = MockConfig(
        port=0,
        kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
        heartbeat_interval=0,
        prefill_ms_per_token=0.0,
        decode_ms_per_token=0.0,
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    async with MockWorker(cfg) as w:
        yield w


@dataclass
class Batch:
    """One received KV-event message, decoded with plain msgpack."""

    topic: bytes
    seq: int
    ts: float
    events: list[dict[str, Any]]
    rank: int
    raw_payload: bytes


def decode_frames(frames: list[bytes]) -> Batch:
    """Decode ``[topic, seq8, payload]`` exactly as a third-party subscriber would."""
    assert len(frames) == 3, frames
    topic, seq, payload = frames
    assert len(seq) == 8
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    return Batch(topic, int.from_bytes(seq, "big"), ts, events, rank, payload)


class Subscriber:
    """A SUB socket on a worker's PUB; ``synced`` waits for a heartbeat so no later batch is lost."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.subscribe(topic)

    async def recv(self, timeout: float = 5.0) -> Batch:
        frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        return decode_frames(frames)

    async def recv_events(self, timeout: float = 5.0) -> Batch:
        """Next batch that carries events (heartbeats skipped)."""
        while True:
            b = await self.recv(timeout)
            if b.events:
                return b

    async def synced(self) -> Batch:
        """Wait for the first message (a heartbeat): from then on the subscription is live."""
        return await self.recv(timeout=10.0)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@contextlib.asynccontextmanager
async def subscribed(worker: MockWorker, topic: bytes = b"") -> AsyncIterator[Subscriber]:
    sub = Subscriber(worker.kv_events_endpoint or "", topic)
    try:
        yield sub
    finally:
        sub.close()


async def replay(endpoint: str, start_seq: int, timeout: float = 5.0, *, partial: bool = False) -> list[list[bytes]]:
    """Ask a replay ROUTER from a DEALER; returns every answer up to and including the end marker
    (``[b"", b"", ff*8, b""]`` or, without a topic frame, ``[b"", ff*8, b""]``).  ``partial``: a reply that
    stops without the end marker returns what came instead of raising TimeoutError."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    answers: list[list[bytes]] = []
    try:
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
            except TimeoutError:
                if partial:
                    return answers
                raise
            answers.append(frames)
            if frames[-2] == b"\xff" * 8 and frames[-1] == b"":
                return answers
    finally:
        sock.close(linger=0)
        ctx.term()


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "mock-model", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def ids_body(ids: list[int], **extra: Any) -> dict[str, Any]:
    """A chat request with ``prompt_token_ids``: exact control over the prompt length in tokens."""
    return {"model": "mock-model", "messages": [], "prompt_token_ids": ids, "max_tokens": 2, **extra}


def int_type_bytes(payload: bytes) -> list[int]:
    """Walk a msgpack document and return the type byte of every INTEGER in it (independent of msgpack-python).

    Lets a test prove that the int64 encoding really uses 0xd3 instead of trusting a round trip.
    """
    found: list[int] = []
    pos = 0

    def walk() -> None:
        nonlocal pos
        b = payload[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0:
            found.append(b)
        elif 0x80 <= b <= 0x8F:
            for _ in range((b & 0x0F) * 2):
                walk()
        elif 0x90 <= b <= 0x9F:
            for _ in range(b & 0x0F):
                walk()
        elif 0xA0 <= b <= 0xBF:
            pos += b & 0x1F
        elif b in (0xC0, 0xC2, 0xC3):
            pass
        elif b in (0xCA, 0xCB):
            pos += 4 if b == 0xCA else 8
        elif b in (0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3):
            found.append(b)
            pos += {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}[b]
        elif b in (0xD9, 0xDA, 0xDB, 0xC4, 0xC5, 0xC6):
            width = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}[b]
            n = int.from_bytes(payload[pos : pos + width], "big")
            pos += width + n
        elif b in (0xDC, 0xDD):
            width = 2 if b == 0xDC else 4
            n = int.from_bytes(payload[pos : pos + width], "big")
            pos += width
            for _ in range(n):
                walk()
        elif b in (0xDE, 0xDF):
            width = 2 if b == 0xDE else 4
            n = int.from_bytes(payload[pos : pos + width], "big")
            pos += width
            for _ in range(2 * n):
                walk()
        else:
            raise ValueError(f"unexpected msgpack type byte {b:#x}")

    walk()
    assert pos == len(payload)
    return found


def float_type_byte(payload: bytes) -> int:
    """Type byte of ``ts`` (the first element of the payload array)."""
    assert payload[0] == 0x93, "payload must be a 3-element array"
    return payload[1]


