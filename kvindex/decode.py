"""Pure decoding of KV-event wire data into :mod:`kvindex.events` objects.

Accepts every variant the engines send: TensorRT-LLM map events in the compact (msgspec) and all-int64 (C++)
msgpack encodings; vLLM <= 0.31 / SGLang < 0.5 positional-array events and vLLM 0.32+ / SGLang 0.5 tagged-map
events (one declared field order, :data:`STORED_FIELDS`, serves both); the 2-element, 3-element and map
envelopes; vLLM's per-block ``extra_keys`` (LoRA name on every block, cache salt on the first, raw tuples or
typed keys, multimodal ``(identifier, offset)`` pairs or older bare identifiers), TensorRT-LLM's per-block
``mm_keys`` (V1 serializer and native V2 shapes), SGLang's typed ``cache_salt`` and its bigram (EAGLE) pages.  Nothing here raises on bad input: a publisher bug or a hostile peer must not be
able to kill a subscriber, so garbage is reported in the returned :class:`DecodedBatch` and counted upstream.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import msgpack
import xxhash

from kvindex import native
from kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunksRemoved,
    ChunksStored,
    DecodeCounters,
    DecodedBatch,
    Event,
)
from kvindex.hashing import (
    DIALECT_TRTLLM,
    DIALECT_VLLM,
    DIALECT_VLLM_BARE,
    mm_bare_key,
    mm_pair_key,
    mm_trtllm_key,
    pack_tokens,
)
from kvindex.tiers import TIER_GPU, TIER_SHARED, TIER_UNKNOWN, medium_tier

_xxh3 = xxhash.xxh3_64_intdigest
MASK64 = 0xFFFFFFFFFFFFFFFF
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
MAX_HASHES_PER_EVENT = 1_000_000
MAX_BLOCK_SIZE = 1 << 16
REPLAY_END_SEQ = MASK64  # ff ff ff ff ff ff ff ff ends a replay
TOO_MANY_EVENTS = "too many events"

# One declared field order per event, shared by the map and the positional-array encodings.  vLLM <= 0.31 and
# SGLang < 0.5 send msgspec ``array_like`` events (``[tag, *fields]`` in this order, trailing fields optional);
# vLLM 0.32+ and SGLang 0.5 send tagged maps (``{"type": tag, field: value}``), like TensorRT-LLM.
STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
# keys newer engines add are known, so they are not counted as unknown: those that carry nothing the index needs
# (vLLM: event_version, locality, ownership, session_id; SGLang 0.5: session_id) and those read outside the
# declared field order (cache_salt; TensorRT-LLM's per-block mm_keys)
_KNOWN_STORED = frozenset(
    (*STORED_FIELDS, "type", "mm_keys", "locality", "ownership", "session_id", "event_version", "cache_salt")
)
_KNOWN_REMOVED = frozenset((*REMOVED_FIELDS, "type", "locality", "ownership", "session_id"))
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


def _medium(medium: object, counters: DecodeCounters) -> str:
    """The event's tier (kvindex/tiers.py). A non-GPU medium is indexed under its tier since issue 44; before,
    such an event was skipped (`skipped_medium`)."""
    if medium is None or medium == "GPU":  # the spelling every engine sends: no case fold per event
        return TIER_GPU
    if type(medium) is not str:
        raise _Garbage("medium is not a string")
    tier = medium_tier(medium)
    if tier == TIER_UNKNOWN:
        counters.unknown_medium += 1
    return tier


def _check_group(group_idx: object) -> None:
    if group_idx is None:
        return
    if type(group_idx) is not int:
        raise _Garbage("group_idx is not an int")
    if group_idx != 0:
        raise _Skip("skipped_group")


def _block_keys(entry: object) -> tuple[list[str], list[tuple[str, int]]]:
    """One block's ``extra_keys`` entry -> (its string keys, its multimodal ``(identifier, offset)`` pairs).

    What vLLM publishes (vllm/v1/core/kv_cache_utils.py ``generate_block_hash_extra_keys`` and
    ``to_event_extra_keys``, vLLM 0.32.0): per block ``lora + mm + cache_salt + prompt_embeds``, untagged: the
    LoRA name and the salt as strings, each multimodal item as an ``(identifier, offset)`` pair (older versions:
    the bare identifier string), prompt embeddings as a bytes digest.  Typed tagged maps
    (``{"type": "lora", "name": ...}``, ``{"type": "cache_salt", "salt": ...}``) are read as their strings.
    Anything else (prompt-embedding bytes, other typed keys) is data the request side does not have: skipped.
    """
    if entry is None:
        return [], []
    if type(entry) not in _SEQ:
        raise _Garbage("extra_keys entry is not a list")
    strings: list[str] = []
    pairs: list[tuple[str, int]] = []
    for item in entry:
        t = type(item)
        if t is str:
            strings.append(item)
        elif t in _SEQ and len(item) == 2 and type(item[0]) is str and type(item[1]) is int:  # type: ignore[arg-type, index]
            pairs.append((item[0], item[1]))  # type: ignore[index]
        elif t is dict:
            kind = item.get("type")
            val = item.get("name") if kind == "lora" else item.get("salt") if kind == "cache_salt" else None
            if type(val) is not str:
                raise _Skip("skipped_extra_keys")
            strings.append(val)
        else:
            raise _Skip("skipped_extra_keys")
    return strings, pairs


MAX_MM_HASH_BYTES = 256  # TensorRT-LLM's MmKey hash is 32 bytes; anything far larger is not a digest


def _mm_hash(h: object) -> bytes:
    if type(h) is str:
        try:
            b = bytes.fromhex(h)
        except ValueError as exc:
            raise _Garbage("mm_keys hash is not hex") from exc
    elif isinstance(h, bytes | bytearray):
        b = bytes(h)
    else:
        raise _Garbage("mm_keys hash is not a hex string or bytes")
    if not b or len(b) > MAX_MM_HASH_BYTES:
        raise _Garbage("mm_keys hash has an absurd size")
    return b


def _trtllm_mm(raw: object, n_blocks: int) -> tuple[list[bytes | None], int]:
    """TensorRT-LLM per-block ``mm_keys`` -> (per-block key bytes, blocks with keys).

    One entry per block, each a list of that block's keys.  A key is ``{"type": "mm_key", "hash": <hex>,
    "start_offset": n}`` (the V2 msgspec wire tags it, NVIDIA/TensorRT-LLM 13599e98
    tensorrt_llm/_torch/pyexecutor/kv_cache_events.py ``MultimodalKey``, as the V1 serializer does) or the same
    map untagged, with ``uuid`` only where the engine sends one (a ``[hash, start_offset(, uuid)]`` array is
    read the same).  ``start_offset`` is where the block starts inside the item
    (NVIDIA/TensorRT-LLM cpp/tensorrt_llm/batch_manager/blockKey.cpp ``generateBlockHashExtraKeys``: 0 when the
    item starts inside the block).  The keys are indexed as given: the chain's own token ids plus these keys.
    """
    if type(raw) not in _SEQ:
        raise _Garbage("mm_keys is not a list")
    if len(raw) != n_blocks:  # type: ignore[arg-type]
        raise _Skip("skipped_mm_shape")  # not one entry per block: a shape we do not know, never guessed
    out: list[bytes | None] = []
    n = 0
    for entry in raw:  # type: ignore[attr-defined]
        if not entry:
            out.append(None)
            continue
        if type(entry) not in _SEQ:
            raise _Skip("skipped_mm_shape")
        keys: list[tuple[bytes, int, str | None]] = []
        for k in entry:
            if type(k) is dict:
                kind = k.get("type")
                if kind is not None and kind != "mm_key":
                    raise _Skip("skipped_mm_shape")
                h, off, uuid = k.get("hash"), k.get("start_offset"), k.get("uuid")
            elif type(k) in _SEQ and 2 <= len(k) <= 3:
                h, off, uuid = k[0], k[1], k[2] if len(k) == 3 else None
            else:
                raise _Skip("skipped_mm_shape")
            if type(off) is not int:
                raise _Garbage("mm_keys start_offset is not an int")
            if uuid is not None and type(uuid) is not str:
                raise _Garbage("mm_keys uuid is not a string")
            keys.append((_mm_hash(h), off, uuid))
        out.append(mm_trtllm_key(keys))
        n += 1
    return out, n


_Identity = tuple[str | None, str | None, list[bytes | None] | None, str | None]


def _identity(
    extra_keys: object, n_blocks: int, root: bool, lora_name: object, lora_id: object, cache_salt: object,
    mm_keys: object, counters: DecodeCounters,
) -> _Identity:
    """(LoRA adapter, cache salt, per-block media keys, media dialect) the event's chain is hashed with, the way
    the engine hashed it.

    vLLM assembles each block's extra keys as ``lora + mm + salt`` with the LoRA name on every block and the
    salt on the chain's first block only; SGLang 0.5 sends the salt as a typed ``cache_salt`` field.  Only a
    chain that starts at the root needs the salt: a continuation inherits it through its parent's hash.
    Media keys: vLLM 0.32 ``(identifier, offset)`` pairs, older vLLM bare identifier strings, TensorRT-LLM
    ``mm_keys``; see kvindex/hashing.py for how a block is keyed with them.  Older vLLM puts a bare identifier
    and the salt in one list of strings, so on a root chain's first block ONE string is read as the salt and
    several as that block's keys (the request side applies the same rule: kvindex.hashing.media_chain_hashes).
    """
    if lora_name is not None and type(lora_name) is not str:
        raise _Garbage("lora_name is not a string")
    if lora_id is not None and type(lora_id) is not int:
        raise _Garbage("lora_id is not an int")
    if cache_salt is not None and type(cache_salt) is not str:
        raise _Garbage("cache_salt is not a string")
    lora = lora_name or None
    salt = cache_salt or None
    has_lora = lora is not None or lora_id is not None
    mm: list[bytes | None] | None = None
    dialect: str | None = None
    n_trtllm = n_pair = n_bare = 0
    if mm_keys:
        mm, n_trtllm = _trtllm_mm(mm_keys, n_blocks)
        if n_trtllm:
            dialect = DIALECT_TRTLLM
        else:
            mm = None
    if extra_keys is not None:
        if type(extra_keys) not in _SEQ:
            raise _Garbage("extra_keys is not a list")
        if extra_keys and len(extra_keys) != n_blocks:
            raise _Garbage("extra_keys does not have one entry per block")
        for i, entry in enumerate(extra_keys):
            keys, pairs = _block_keys(entry)
            if has_lora and keys:
                name = keys.pop(0)
                if lora is None:
                    lora = name
                elif name != lora:
                    raise _Garbage("extra_keys names another LoRA adapter than lora_name")
            first = i == 0 and root
            if pairs:
                if dialect is not None and dialect != DIALECT_VLLM:
                    raise _Skip("skipped_mm_shape")
                if keys and (not first or len(keys) > 1):
                    raise _Skip("skipped_extra_keys")  # a string key we cannot place: do not guess
                dialect = DIALECT_VLLM
                if mm is None:
                    mm = [None] * n_blocks
                mm[i] = mm_pair_key(pairs)
                n_pair += 1
            elif keys and not (first and len(keys) == 1):
                # strings other than the LoRA name and the root's lone salt: older vLLM's bare identifiers
                if dialect is not None and dialect != DIALECT_VLLM_BARE or (first and salt is not None):
                    raise _Skip("skipped_mm_shape")
                dialect = DIALECT_VLLM_BARE
                if mm is None:
                    mm = [None] * n_blocks
                mm[i] = mm_bare_key(keys)
                n_bare += 1
                keys = []
            if keys:
                if salt is not None and keys[0] != salt:
                    raise _Garbage("extra_keys salt disagrees with cache_salt")
                salt = keys[0]
    if has_lora and lora is None:
        raise _Skip("skipped_extra_keys")  # a LoRA block whose adapter name we are not told
    if n_pair or n_bare or n_trtllm:
        counters.mm_blocks_vllm += n_pair
        counters.mm_blocks_vllm_bare += n_bare
        counters.mm_blocks_trtllm += n_trtllm
    return lora, salt if root else None, mm, dialect


def _tokens(tokens: object) -> object:
    """Token ids as a flat sequence.  SGLang's EAGLE (speculative decoding) radix cache keys pages by
    bigrams, so its events carry ``[[t0, t1], [t1, t2], ...]``: the page's tokens are the first elements."""
    if type(tokens) not in _SEQ:
        raise _Garbage("token_ids is not a list")
    if tokens and type(tokens[0]) in _SEQ:
        try:
            return [p[0] for p in tokens if len(p) == 2]  # type: ignore[index, arg-type]
        except TypeError as exc:
            raise _Garbage("bigram token_ids are not pairs") from exc
    return tokens


MAX_TOKEN_TEXT = 256  # a string token id is a digest (64 hex chars for the 32-byte hash): anything longer is garbage


def _media_tokens(tokens: list[object]) -> array:
    """TensorRT-LLM's V2 wire allows string token ids (`EventTokenId = int | str`, NVIDIA/TensorRT-LLM 13599e98
    tensorrt_llm/_torch/pyexecutor/kv_cache_events.py): with multimodal keys on, the native sink reports a media
    item's first token as text (its digest). Such a token is packed as the low 32 bits of its xxh3: the block is
    keyed by its `mm_keys` (the same digest) as well, and no rendered prompt carries that token, so the index
    stays exact for the engine's own chains and no request is credited through it. Only for blocks whose event
    carries TensorRT-LLM `mm_keys`; a string token anywhere else is garbage."""
    out: list[int] = []
    for t in tokens:
        if type(t) is str:
            if len(t) > MAX_TOKEN_TEXT:
                raise _Garbage("token id text is too long")
            out.append(_xxh3(t.encode()) & 0xFFFFFFFF)
        else:
            out.append(t)  # type: ignore[arg-type]
    try:
        return pack_tokens(out)
    except (TypeError, OverflowError, ValueError) as exc:
        raise _Garbage("token id is not a u32") from exc


def _stored(ev: dict, counters: DecodeCounters) -> BlockStored:
    g = ev.get
    hs = _norm_hashes(g("block_hashes"))
    block_size = g("block_size")
    raw_tokens = g("token_ids")
    tier = _medium(g("medium"), counters)
    if block_size == 0 and tier != TIER_GPU and not raw_tokens:
        # vLLM's legacy offload event (vllm-project/vllm 896c8e6e .../kv_connector/v1/offloading/events.py
        # `_placeholder_stored`: one hash per offload chunk, `token_ids=[]`, no parent, `block_size=0`): the
        # prefix's tokens are not there, so no key can be computed; vLLM's `self_describing_kv_events` fixes it
        raise _Skip("skipped_placeholder")
    if type(block_size) is not int or not 0 < block_size <= MAX_BLOCK_SIZE:
        raise _Garbage("bad block_size")
    tokens = _tokens(raw_tokens)
    if tokens is not raw_tokens and len(tokens) != len(raw_tokens):  # type: ignore[arg-type]
        raise _Garbage("bigram token_ids are not pairs")
    parent = g("parent_block_hash")
    par = None if parent is None else _norm_hash(parent)
    _check_group(g("group_idx"))
    if len(tokens) != block_size * len(hs):  # type: ignore[arg-type]
        raise _Skip("skipped_length")
    extra_keys, lora_name, lora_id, cache_salt, mm_keys = (g("extra_keys"), g("lora_name"), g("lora_id"),
                                                           g("cache_salt"), g("mm_keys"))
    probe = None
    if extra_keys is None and lora_name is None and lora_id is None and cache_salt is None and not mm_keys:
        # a plain text chain, nearly every event: what `_identity` returns for it, without its checks and
        # counters (a fifth of the decode's cost per event at 10 batches/s per worker)
        lora = salt = mm = dialect = None
    else:
        probe = DecodeCounters()  # counted only once the whole event decoded
        lora, salt, mm, dialect = _identity(extra_keys, len(hs), par is None, lora_name, lora_id, cache_salt,
                                            mm_keys, probe)
    try:
        packed = pack_tokens(tokens)  # type: ignore[arg-type]
    except (TypeError, OverflowError, ValueError) as exc:
        if mm is None or dialect != DIALECT_TRTLLM:
            raise _Garbage("token id is not a u32") from exc
        packed = _media_tokens(tokens)  # type: ignore[arg-type]
    if mm is not None and probe is not None:
        counters.mm_blocks_vllm += probe.mm_blocks_vllm
        counters.mm_blocks_vllm_bare += probe.mm_blocks_vllm_bare
        counters.mm_blocks_trtllm += probe.mm_blocks_trtllm
    return BlockStored(hs, par, packed, block_size, lora, lora_id, salt, mm, dialect, tier)


def _removed(ev: dict, counters: DecodeCounters) -> BlockRemoved:
    hs = _norm_hashes(ev.get("block_hashes"))
    tier = _medium(ev.get("medium"), counters)
    _check_group(ev.get("group_idx"))
    return BlockRemoved(hs, tier)


def _decode_event(tag: object, ev: dict, counters: DecodeCounters) -> Event | None:
    if tag == "BlockStored":
        if not ev.keys() <= _KNOWN_STORED:
            counters.unknown_keys += len(ev.keys() - _KNOWN_STORED)
        return _stored(ev, counters)
    if tag == "BlockRemoved":
        if not ev.keys() <= _KNOWN_REMOVED:
            counters.unknown_keys += len(ev.keys() - _KNOWN_REMOVED)
        return _removed(ev, counters)
    if tag == "AllBlocksCleared":
        if not ev.keys() <= _KNOWN_CLEARED:
            counters.unknown_keys += len(ev.keys() - _KNOWN_CLEARED)
        return AllBlocksCleared()
    if type(tag) is not str:
        raise _Garbage("event without a string type tag")
    counters.unknown_events += 1
    return None


_ARRAY_FIELDS = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS, "AllBlocksCleared": ()}
_ARRAY_MIN = {"BlockStored": 5, "BlockRemoved": 2}


def _array_event(ev: tuple, counters: DecodeCounters) -> Event | None:
    """A positional event -> the same map the map encoding gives, through the one declared field order."""
    if not ev or type(ev[0]) is not str:
        raise _Garbage("array event without a string tag")
    tag = ev[0]
    fields = _ARRAY_FIELDS.get(tag)
    if fields is None:
        counters.unknown_events += 1
        return None
    if len(ev) < _ARRAY_MIN.get(tag, 1):
        raise _Garbage(f"short {tag} array")
    return _decode_event(tag, dict(zip(fields, ev[1:], strict=False)), counters)


def _opt(seq: Sequence[object], i: int) -> object:
    return seq[i] if len(seq) > i else None


def _garbage(reason: str) -> DecodedBatch:
    return DecodedBatch(garbage=True, reason=reason)


_TS_SIZE = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}


def peek_event_count(payload: bytes | bytearray | memoryview) -> int | None:
    """The length of an array envelope's events array read from the msgpack headers alone (O(1)), so a batch
    over the event budget is refused without unpacking it; None for other shapes (map envelopes)."""
    if len(payload) < 3 or payload[0] not in (0x92, 0x93):
        return None
    b = payload[1]
    i = 2 if b <= 0x7F or b >= 0xE0 else 1 + _TS_SIZE.get(b, 0)
    if i == 1 or i >= len(payload):
        return None
    h = payload[i]
    if 0x90 <= h <= 0x9F:
        return h & 0x0F
    if h == 0xDC and i + 3 <= len(payload):
        return int.from_bytes(payload[i + 1 : i + 3], "big")
    if h == 0xDD and i + 5 <= len(payload):
        return int.from_bytes(payload[i + 1 : i + 5], "big")
    return None


_native_decode = native.MODULE.decode if native.MODULE is not None else None


def _decode_native(payload: Any, max_events: int | None) -> DecodedBatch | None:
    """The C accelerator's decode of the common batch shape (kvindex/_csrc/native.c: text chains, removals and
    clears, nothing to count), or None: anything else, or no accelerator, is decoded by the pure path below,
    which owns every rule.  Its events are exactly what the pure path makes of the same bytes (tested)."""
    if not isinstance(payload, bytes | bytearray | memoryview) or len(payload) > MAX_PAYLOAD_BYTES:
        return None
    if max_events is not None:
        n = peek_event_count(payload)
        if n is not None and n > max_events:
            return None
    try:
        got = _native_decode(payload)  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - a MemoryError building the objects: the pure path decides
        return None
    if got is None:
        return None
    ts, rank, n_events, raw = got
    if max_events is not None and n_events > max_events:
        return None
    out: list[Event] = []
    append = out.append
    for ev in raw:
        kind = ev[0]
        if kind == 0:
            packed = array("I")
            packed.frombytes(ev[3])  # little-endian u32, as pack_tokens makes them on any host
            append(BlockStored(ev[1], ev[2], packed, ev[4]))
        elif kind == 1:
            append(BlockRemoved(ev[1]))
        else:
            append(AllBlocksCleared())
    return DecodedBatch(ts, out, rank, n_events, DecodeCounters())


def decode_payload(payload: bytes | bytearray | memoryview, max_events: int | None = None) -> DecodedBatch:
    """Decode one msgpack batch payload.  Never raises; see :class:`DecodedBatch` for the outcome.

    ``max_events``: a batch with more events is refused (``garbage``, ``reason == TOO_MANY_EVENTS``,
    ``raw_event_count`` set) before any per-event work, so its cost is one C-level unpack of a bounded payload.
    """
    if _native_decode is not None:
        fast = _decode_native(payload, max_events)
        if fast is not None:
            return fast
    return _decode_payload_py(payload, max_events)


def _decode_payload_py(payload: bytes | bytearray | memoryview, max_events: int | None = None) -> DecodedBatch:
    """:func:`decode_payload` in pure Python: every shape, every rule, every counter."""
    obj = _unpack_bounded(payload, max_events)
    if type(obj) is DecodedBatch:
        return obj
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
    if max_events is not None and len(events) > max_events:
        return DecodedBatch(garbage=True, reason=TOO_MANY_EVENTS, raw_event_count=len(events))
    counters = DecodeCounters()
    out: list[Event] = []
    append = out.append
    for ev in events:
        try:
            t = type(ev)
            if t is dict:
                dec = _decode_event(ev.get("type"), ev, counters)
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


# ---------------------------------------------------------------- llm-d's file-system connector stream
# What llm-d's fs connector publishes, read at llm-d/llm-d-kv-cache 7be76e119ca50c5700b3bca65a19b6a0218a9b62
# kv_connectors/llmd_fs_backend/llmd_fs_backend/event_publisher.py (`StorageEventPublisher`) and manager.py:
#   * its own PUB socket, bound at the connector's `storage_events_endpoint` (kv_connector_extra_config, with
#     `enable_events: true`), frames `[topic, seq (8 bytes big-endian, from 1), payload]`, topic
#     `kv@<medium>@<model>`, medium `SHARED_STORAGE` (POSIX backend) or `OBJECT_STORE` (`backend: OBJ`);
#     no replay socket;
#   * payload `msgpack([time.time(), [event, ...]])` where each event is itself PRE-PACKED: a msgpack bin
#     holding the positional event (`_send_batch` packs `[ts, packed_events]`);
#   * `["BlockStored", [hash, ...], 0, [], 0, None, medium]` per `complete_store` (parent 0, no tokens,
#     block_size 0, lora_id None) and `["BlockRemoved", [hash, ...], medium]`, sent by llm-d's PVC evictor
#     (kv_connectors/pvc_evictor/processes/deleter.py) when it deletes files;
#   * each hash is `get_offload_block_hash(key)` masked to its low 64 bits (`_hash_to_uint64`: bytes read
#     big-endian): vLLM's OffloadKey is the block hash + group index, and the offloading scheduler keys chunk
#     k by `req.block_hashes[hashes_per_chunk * k + hashes_per_chunk - 1]` (vllm-project/vllm
#     .../kv_connector/v1/offloading/scheduler.py, e57c0d42 `_get_block_hashes`; newer `update_offload_keys`):
#     the hash of the chunk's LAST GPU block, the same u64 vLLM's own GPU events carry for that block
#     (`maybe_convert_block_hash`: big-endian, low 64 bits, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES default 1).
# One hash names a whole chunk (the connector's `block_size` tokens, 256 by default, i.e. 16 GPU blocks of
# 16): kvindex.index keys it through the engine hash it names and credits the chunk's GPU-block positions.
_STORAGE_TAGS = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}


def _storage_hash(h: object) -> int:
    """A storage hash as the connector masks it: an int's low 64 bits, bytes read big-endian (low 64 bits)."""
    if type(h) is int:
        return h & MASK64
    if isinstance(h, bytes | bytearray) and 0 < len(h) <= 64:
        return int.from_bytes(h, "big") & MASK64
    raise _Garbage("hash is neither an int nor bytes")


def _storage_event(ev: object, counters: DecodeCounters) -> ChunksStored | ChunksRemoved | None:
    """One event of the connector's batch: a bin blob holding a positional event (its only form), or the event
    itself (array or map, as vLLM's own stream sends them). Nothing but these two tags is applied."""
    if isinstance(ev, bytes):
        ev = msgpack.unpackb(ev, raw=False, strict_map_key=False, use_list=False)  # bounded by the payload
    if type(ev) is tuple:
        if not ev or type(ev[0]) is not str:
            raise _Garbage("array event without a string tag")
        fields = _STORAGE_TAGS.get(ev[0])
        if fields is None:
            counters.unknown_events += 1
            return None
        tag, ev = ev[0], dict(zip(fields, ev[1:], strict=False))
    elif type(ev) is dict:
        tag = ev.get("type")
        if tag not in _STORAGE_TAGS:
            if type(tag) is not str:
                raise _Garbage("event without a string type tag")
            counters.unknown_events += 1  # AllBlocksCleared too: a store outlives any one publisher
            return None
    else:
        raise _Garbage("event is neither a map nor an array")
    raw = ev.get("block_hashes")
    if type(raw) not in _SEQ or not raw or len(raw) > MAX_HASHES_PER_EVENT:
        raise _Garbage("block_hashes is not a non-empty list")
    hashes = [_storage_hash(h) for h in raw]
    medium = ev.get("medium")
    if type(medium) is not str:
        raise _Garbage("medium is not a string")
    _check_group(ev.get("group_idx"))
    if medium_tier(medium) != TIER_SHARED:
        raise _Skip("skipped_storage_shape")  # e.g. a GPU stream given as the storage endpoint
    if tag == "BlockRemoved":
        return ChunksRemoved(hashes, medium)
    # the connector's exact shape; a tokenful (self-describing) store is another protocol: never guessed at
    if ev.get("parent_block_hash") not in (0, None) or ev.get("token_ids") not in ((), [], None) \
            or ev.get("block_size") not in (0, None) or ev.get("lora_id") is not None \
            or ev.get("lora_name") is not None or ev.get("extra_keys") is not None:
        raise _Skip("skipped_storage_shape")
    return ChunksStored(hashes, medium)


def _unpack_bounded(payload: Any, max_events: int | None) -> Any:
    """The checks every stream's batch passes before any per-event work (a bytes payload within
    MAX_PAYLOAD_BYTES, at most `max_events` events by a peek), then one C-level unpack: the unpacked object,
    or a garbage `DecodedBatch` saying which check failed (msgpack decodes no DecodedBatch, so the type tells
    the two apart)."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        return _garbage("payload is not bytes")
    if len(payload) > MAX_PAYLOAD_BYTES:
        return _garbage("payload too large")
    if max_events is not None:
        n = peek_event_count(payload)
        if n is not None and n > max_events:
            return DecodedBatch(garbage=True, reason=TOO_MANY_EVENTS, raw_event_count=n)
    try:
        # tuples, not lists: ~40% cheaper to build, and the ints are the bulk of every payload
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, ExtraData, StackError, ...)
        return _garbage(f"msgpack: {type(exc).__name__}")


def decode_storage_payload(payload: bytes | bytearray | memoryview, max_events: int | None = None) -> DecodedBatch:
    """Decode one batch of llm-d's file-system connector stream (see the block above) into
    :class:`ChunksStored` / :class:`ChunksRemoved` events. Never raises: a malformed batch is ``garbage``, a
    malformed event counted (``garbage_events``) and dropped, like :func:`decode_payload`."""
    obj = _unpack_bounded(payload, max_events)
    if type(obj) is DecodedBatch:
        return obj
    if type(obj) is tuple and len(obj) >= 2:
        ts, events = obj[0], obj[1]
    elif type(obj) is dict:
        ts, events = obj.get("ts"), obj.get("events")
    else:
        return _garbage("envelope is not a [ts, events] array or map")
    if type(ts) not in (int, float) or type(events) is not tuple:
        return _garbage("envelope has wrong types")
    if max_events is not None and len(events) > max_events:
        return DecodedBatch(garbage=True, reason=TOO_MANY_EVENTS, raw_event_count=len(events))
    counters = DecodeCounters()
    out: list[Event] = []
    for ev in events:
        try:
            dec = _storage_event(ev, counters)
        except _Skip as skip:
            setattr(counters, skip.args[0], getattr(counters, skip.args[0]) + 1)
            continue
        except Exception:  # noqa: BLE001 - _Garbage, a nested msgpack error, unhashable keys: one bad event
            counters.garbage_events += 1
            continue
        if dec is not None:
            out.append(dec)
    return DecodedBatch(float(ts), out, None, len(events), counters)


def split_live_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes] | None:
    """``[topic, seq8, payload]`` from the PUB socket -> (topic, seq, payload); None if malformed."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return bytes(frames[0]), int.from_bytes(frames[1], "big"), frames[2]


def split_replay_frames(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """One replay reply -> (seq, payload); None if malformed.

    TensorRT-LLM and vLLM 0.32+ answer ``[b"", topic, seq8, payload]`` (4 frames), vLLM <= 0.31 and SGLang
    ``[b"", seq8, payload]`` (3 frames); the end marker has seq ``ff..ff`` (:data:`REPLAY_END_SEQ`).  The
    leading empty delimiter is optional.
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
    "REMOVED_FIELDS",
    "STORED_FIELDS",
    "REPLAY_END_SEQ",
    "decode_payload",
    "decode_storage_payload",
    "encode_seq",
    "split_live_frames",
    "split_replay_frames",
]
