"""Pure decoding of KV-event wire data into :mod:`kvindex.events` objects.

Accepts every variant listed in the worker reference (section 3): TensorRT-LLM map events in the compact
(msgspec) and all-int64 (C++) msgpack encodings, vLLM/SGLang positional-array events, and the 2-element,
3-element and map envelopes.  Nothing here raises on bad input: a publisher bug or a hostile peer must not be
able to kill a subscriber, so garbage is reported in the returned :class:`DecodedBatch` and counted upstream.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeCounters,
    DecodedBatch,
    Event,
)
from kvindex.hashing import pack_tokens

MASK64 = 0xFFFFFFFFFFFFFFFF
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
MAX_HASHES_PER_EVENT = 1_000_000
MAX_BLOCK_SIZE = 1 << 16
REPLAY_END_SEQ = MASK64  # ff ff ff ff ff ff ff ff ends a replay

_KNOWN_STORED = frozenset(
    {
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "group_idx", "extra_keys", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
        "locality", "mm_keys",
    }
)
_KNOWN_REMOVED = frozenset({"type", "block_hashes", "medium", "group_idx", "locality"})
_KNOWN_CLEARED = frozenset({"type"})
_SEQ = (tuple, list)


class _Garbage(Exception):
    """Internal: one event is malformed; the caller counts and drops it."""


class _Skip(Exception):
    """Internal: one event is well-formed but must not be applied (counter attribute named in args[0])."""


def _norm_hash(h: object) -> int:
    """Engine hash -> u64.  Signed and unsigned ints map to the same value; bytes hashes (newer vLLM) are
    folded to their first 8 bytes, which is enough because they are only ever compared with themselves."""
    if type(h) is int:
        return h & MASK64
    if isinstance(h, bytes | bytearray) and h:
        return int.from_bytes(bytes(h[:8]).ljust(8, b"\0"), "big")
    raise _Garbage("hash is not an int")


def _norm_hashes(raw: object) -> list[int]:
    if type(raw) not in _SEQ:
        raise _Garbage("block_hashes is not a list")
    if len(raw) > MAX_HASHES_PER_EVENT:
        raise _Garbage("absurd number of block hashes")
    try:
        return [h & MASK64 for h in raw]
    except TypeError:
        return [_norm_hash(h) for h in raw]


def _check_medium(medium: object) -> None:
    if medium is None:
        return
    if type(medium) is not str:
        raise _Garbage("medium is not a string")
    if medium.upper() != "GPU":
        raise _Skip("skipped_medium")


def _check_group(group_idx: object) -> None:
    if group_idx is None:
        return
    if type(group_idx) is not int:
        raise _Garbage("group_idx is not an int")
    if group_idx != 0:
        raise _Skip("skipped_group")


def _has_extra(extra_keys: object, mm_keys: object) -> bool:
    """True when blocks carry identity beyond their token ids (images, per-block extra keys)."""
    if mm_keys:
        return True
    if extra_keys is None:
        return False
    if type(extra_keys) not in _SEQ:
        return True
    return any(k is not None and k != () for k in extra_keys)


def _stored(
    hashes: object, parent: object, tokens: object, block_size: object, lora_id: object, medium: object,
    lora_name: object, group_idx: object, extra_keys: object, mm_keys: object,
) -> BlockStored:
    hs = _norm_hashes(hashes)
    if type(block_size) is not int or not 0 < block_size <= MAX_BLOCK_SIZE:
        raise _Garbage("bad block_size")
    if type(tokens) not in _SEQ:
        raise _Garbage("token_ids is not a list")
    if lora_name is not None and type(lora_name) is not str:
        raise _Garbage("lora_name is not a string")
    if lora_id is not None and type(lora_id) is not int:
        raise _Garbage("lora_id is not an int")
    par = None if parent is None else _norm_hash(parent)
    _check_medium(medium)
    _check_group(group_idx)
    if len(tokens) != block_size * len(hs):
        raise _Skip("skipped_length")
    if _has_extra(extra_keys, mm_keys):
        raise _Skip("skipped_extra_keys")
    try:
        packed = pack_tokens(tokens)
    except (TypeError, OverflowError, ValueError) as exc:
        raise _Garbage("token id is not a u32") from exc
    return BlockStored(hs, par, packed, block_size, lora_name or None, lora_id)


def _removed(hashes: object, medium: object, group_idx: object) -> BlockRemoved:
    hs = _norm_hashes(hashes)
    _check_medium(medium)
    _check_group(group_idx)
    return BlockRemoved(hs)


def _map_event(ev: dict, counters: DecodeCounters) -> Event | None:
    tag = ev.get("type")
    g = ev.get
    if tag == "BlockStored":
        if not ev.keys() <= _KNOWN_STORED:
            counters.unknown_keys += len(ev.keys() - _KNOWN_STORED)
        return _stored(
            g("block_hashes"), g("parent_block_hash"), g("token_ids"), g("block_size"), g("lora_id"),
            g("medium"), g("lora_name"), g("group_idx"), g("extra_keys"), g("mm_keys"),
        )
    if tag == "BlockRemoved":
        if not ev.keys() <= _KNOWN_REMOVED:
            counters.unknown_keys += len(ev.keys() - _KNOWN_REMOVED)
        return _removed(g("block_hashes"), g("medium"), g("group_idx"))
    if tag == "AllBlocksCleared":
        if len(ev) > 1:
            counters.unknown_keys += len(ev.keys() - _KNOWN_CLEARED)
        return AllBlocksCleared()
    if type(tag) is not str:
        raise _Garbage("event without a string type tag")
    counters.unknown_events += 1
    return None


def _opt(seq: Sequence[object], i: int) -> object:
    return seq[i] if len(seq) > i else None


def _array_event(ev: tuple, counters: DecodeCounters) -> Event | None:
    if not ev or type(ev[0]) is not str:
        raise _Garbage("array event without a string tag")
    tag = ev[0]
    if tag == "BlockStored":
        if len(ev) < 5:
            raise _Garbage("short BlockStored array")
        return _stored(
            ev[1], ev[2], ev[3], ev[4], _opt(ev, 5), _opt(ev, 6), _opt(ev, 7), _opt(ev, 9), _opt(ev, 8), None
        )
    if tag == "BlockRemoved":
        if len(ev) < 2:
            raise _Garbage("short BlockRemoved array")
        return _removed(ev[1], _opt(ev, 2), _opt(ev, 3))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    counters.unknown_events += 1
    return None


def _garbage(reason: str) -> DecodedBatch:
    return DecodedBatch(garbage=True, reason=reason)


def decode_payload(payload: bytes | bytearray | memoryview) -> DecodedBatch:
    """Decode one msgpack batch payload.  Never raises; see :class:`DecodedBatch` for the outcome."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        return _garbage("payload is not bytes")
    if len(payload) > MAX_PAYLOAD_BYTES:
        return _garbage("payload too large")
    try:
        # tuples, not lists: ~40% cheaper to build, and the ints are the bulk of every payload
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, ExtraData, StackError, ...)
        return _garbage(f"msgpack: {type(exc).__name__}")
    if type(obj) is tuple:
        if len(obj) < 2:
            return _garbage("envelope array too short")
        ts, events, rank = obj[0], obj[1], _opt(obj, 2)
    elif type(obj) is dict:
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    else:
        return _garbage("envelope is not an array or map")
    if type(ts) not in (int, float) or type(events) is not tuple:
        return _garbage("envelope has wrong types")
    if rank is not None and (type(rank) is not int or not 0 <= rank < 1 << 16):
        return _garbage("bad data_parallel_rank")
    counters = DecodeCounters()
    out: list[Event] = []
    append = out.append
    for ev in events:
        try:
            t = type(ev)
            if t is dict:
                dec = _map_event(ev, counters)
            elif t is tuple:
                dec = _array_event(ev, counters)
            else:
                raise _Garbage("event is neither a map nor an array")
        except _Skip as skip:
            setattr(counters, skip.args[0], getattr(counters, skip.args[0]) + 1)
            continue
        except _Garbage:
            counters.garbage_events += 1
            continue
        except Exception:  # noqa: BLE001 - e.g. unhashable map keys: still one bad event, never a crash
            counters.garbage_events += 1
            continue
        if dec is not None:
            append(dec)
    return DecodedBatch(float(ts), out, rank, len(events), counters)


def split_live_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes] | None:
    """``[topic, seq8, payload]`` from the PUB socket -> (topic, seq, payload); None if malformed."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return bytes(frames[0]), int.from_bytes(frames[1], "big"), frames[2]


def split_replay_frames(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """One replay reply -> (seq, payload); None if malformed.

    TensorRT-LLM answers ``[b"", topic, seq8, payload]``, vLLM ``[b"", seq8, payload]``; the end marker has
    seq ``ff..ff`` (:data:`REPLAY_END_SEQ`).  The leading empty delimiter is optional.
    """
    f = list(frames)
    if f and len(f[0]) == 0 and len(f) in (3, 4):
        f = f[1:]
    if len(f) == 3:
        f = f[1:]
    if len(f) != 2 or len(f[0]) != 8:
        return None
    return int.from_bytes(f[0], "big"), f[1]


def encode_seq(seq: int) -> bytes:
    """Sequence number as the 8-byte big-endian frame publishers and replay requests use."""
    return (seq & MASK64).to_bytes(8, "big")


__all__ = [
    "MAX_HASHES_PER_EVENT",
    "REPLAY_END_SEQ",
    "decode_payload",
    "encode_seq",
    "split_live_frames",
    "split_replay_frames",
]
