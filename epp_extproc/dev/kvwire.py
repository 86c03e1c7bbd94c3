"""Encoders for KV-event batches in the wire forms the decoder accepts: test and benchmark publishers only.

They live in ``dev/``, outside the request path (the picker only ever decodes; nothing in core, envoy or
adapters imports this), so that tests and benchmarks share them without tests importing ``bench``.  ``trtllm_mock`` has its own int64
packer on purpose: the mock is the engine double the picker is tested against, so it must not share code with
the picker's side of the wire, or one shared bug would make both agree and every test pass.  The
all-int64 form is written by hand, byte by byte, because that is exactly what the TensorRT-LLM C++
serializer does (every integer as msgpack int64 ``0xd3``, floats as float64 ``0xcb``) and no msgpack library
produces it on its own.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Any

import msgpack


def stored_event(
    block_hashes: Sequence[int],
    parent_block_hash: int | None,
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_id: int | None = None,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A TensorRT-LLM ``BlockStored`` map event."""
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent_block_hash,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
    }
    ev.update(extra)
    return ev


def removed_event(block_hashes: Sequence[int], *, medium: str | None = "GPU", **extra: Any) -> dict[str, Any]:
    """A TensorRT-LLM ``BlockRemoved`` map event."""
    ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}
    ev.update(extra)
    return ev


def cleared_event() -> dict[str, Any]:
    """A TensorRT-LLM ``AllBlocksCleared`` map event."""
    return {"type": "AllBlocksCleared"}


def _container_header(n: int, fix: int, head16: int, out: bytearray) -> None:
    """Smallest array/map header (only scalars are widened by the C++ serializer)."""
    if n < 16:
        out.append(fix | n)
    elif n < 1 << 16:
        out.append(head16)
        out += struct.pack(">H", n)
    else:
        out.append(head16 + 1)
        out += struct.pack(">I", n)


def _pack_int64(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xC0)
    elif obj is True or obj is False:
        out.append(0xC3 if obj else 0xC2)
    elif isinstance(obj, int):
        if obj >= 1 << 63:  # u64 hashes go out as their signed int64 bit pattern, as in C++
            obj -= 1 << 64
        out.append(0xD3)
        out += struct.pack(">q", obj)
    elif isinstance(obj, float):
        out.append(0xCB)
        out += struct.pack(">d", obj)
    elif isinstance(obj, str):
        b = obj.encode()
        if len(b) < 32:
            out.append(0xA0 | len(b))
        elif len(b) < 256:
            out += bytes((0xD9, len(b)))
        else:
            out.append(0xDB)
            out += struct.pack(">I", len(b))
        out += b
    elif isinstance(obj, bytes | bytearray):
        out.append(0xC6)
        out += struct.pack(">I", len(obj))
        out += obj
    elif isinstance(obj, list | tuple):
        _container_header(len(obj), 0x90, 0xDC, out)
        for x in obj:
            _pack_int64(x, out)
    elif isinstance(obj, dict):
        _container_header(len(obj), 0x80, 0xDE, out)
        for k, v in obj.items():
            _pack_int64(k, out)
            _pack_int64(v, out)
    else:
        raise TypeError(f"cannot encode {type(obj).__name__}")


def pack_all_int64(obj: Any) -> bytes:
    """msgpack with every int as int64 (0xd3) and every float as float64 (0xcb), like TRT-LLM's C++ side."""
    out = bytearray()
    _pack_int64(obj, out)
    return bytes(out)


def pack_batch(
    events: Sequence[Any],
    *,
    ts: float | None = None,
    rank: int | None = 0,
    envelope: str = "array3",
    all_int64: bool = False,
) -> bytes:
    """One batch payload.  ``envelope``: ``array3`` ``[ts, events, rank]``, ``array2`` ``[ts, events]`` or
    ``map`` ``{ts, events, data_parallel_rank}``."""
    ts = time.time() if ts is None else float(ts)
    if envelope == "array3":
        obj: Any = [ts, list(events), rank]
    elif envelope == "array2":
        obj = [ts, list(events)]
    elif envelope == "map":
        obj = {"ts": ts, "events": list(events), "data_parallel_rank": rank}
    else:
        raise ValueError(f"unknown envelope {envelope!r}")
    if all_int64:
        return pack_all_int64(obj)
    return msgpack.packb(obj, use_bin_type=True)


def storage_stored_event(block_hashes: Sequence[int], medium: str = "SHARED_STORAGE") -> list[Any]:
    """llm-d's file-system connector store event, positional, exactly as its `StorageEventPublisher` builds it
    (llm-d/llm-d-kv-cache 7be76e11 kv_connectors/llmd_fs_backend/llmd_fs_backend/event_publisher.py): one hash
    per offload chunk, parent 0, no tokens, block_size 0, lora_id None."""
    return ["BlockStored", list(block_hashes), 0, [], 0, None, medium]


def storage_removed_event(block_hashes: Sequence[int], medium: str = "SHARED_STORAGE") -> list[Any]:
    """llm-d's storage removal event (its PVC evictor publishes these), positional, as the connector builds it."""
    return ["BlockRemoved", list(block_hashes), medium]


def pack_storage_batch(events: Sequence[Any], *, ts: float | None = None) -> bytes:
    """A batch as the connector's `_send_batch` sends it: `[ts, [bin, ...]]`, each event PRE-PACKED as a msgpack
    bin inside the batch (an event already given as bytes is sent as is)."""
    packed = [e if isinstance(e, bytes) else msgpack.packb(e, use_bin_type=True) for e in events]
    return msgpack.packb([time.time() if ts is None else float(ts), packed], use_bin_type=True)
