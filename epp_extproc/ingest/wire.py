"""The local channel between a picker process and its host's ingest processes: byte layouts, in one place.

Two sockets per ingest shard, both Unix sockets in a private directory:

* the **lookup** socket (``SOCK_SEQPACKET``: connection-oriented, message boundaries kept by the kernel, so a
  request is one ``send`` and its answer one ``recv``, no framing to parse) carries only the request path's
  question, "per worker, how many leading blocks of these hashes?", and its answer;
* the **control** socket (``SOCK_STREAM``, length-prefixed frames) carries everything that is not on the
  request path: the worker set a picker wants indexed, block sizes learned over HTTP, predictions, resyncs,
  and ``/debug/kv`` snapshots.

Only hashes cross the lookup socket: prompts are packed and hashed in the decision process (as today), so the
ingest never sees a token. Hashes travel as native u64 arrays (``array('Q')``), answers as one u32 per row of
the worker table (the blocks that worker holds, 0 for none): dense, because a shard of a thousand workers
then packs and a picker unpacks the answer in C (`array`, `itertools.compress`) instead of a Python loop per
worker, 0.3 ms of a 1 ms lookup at that size. A row refers to the shard's *meta* table (worker addresses, their block
sizes, whether their index is warm, their engine's media-key dialect, the block sizes present), which changes rarely and is only sent back
when the picker's copy (named by its version in each request) is out of date.

The tiered-credit plugin (issue 44) asks a second question with the same request (`FLAG_TIERS`): per worker, its
leading blocks at any tier (GPU, host memory, disk, shared storage) as runs of positions with the same tiers
(`pack_tier_runs`), the in-process `KvIndex.overlap_tiers` answer. It is asked only while a shard's table says it
holds a block off the GPU (`Meta.tiers`), so a GPU-only pool sends exactly the lookups it sent before.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
import xxhash

from kvindex.hashing import pack_u64

if TYPE_CHECKING:
    import numpy as np

# lookup request: op, request id, the meta version the picker holds, flags, number of sections, filter length
_REQ = struct.Struct("<BIIBBI")
_SECTION = struct.Struct("<II")  # block size, number of hashes (then the hashes as u64)
# lookup answer: op, request id, meta version, meta length (0: the picker's copy is current), rows, then the
# shard's own figures for the picker's trace: its service time on this lookup and the lag of its newest applied
# event batch (seconds; NaN: none applied yet)
_ANS = struct.Struct("<BIIIIff")
OP_LOOKUP = 1
# 2 was the answer as (row, blocks) pairs, 3 the answer without the shard's figures: a picker of either version
# finds no answer, and times out (a picker and its shards come from one install)
OP_ANSWER = 4
FLAG_PREDICTED = 1  # count predicted blocks too (overlap); without it: confirmed only (credit)
# answer per worker its leading blocks at ANY tier as runs (`KvIndex.overlap_tiers`, the tiered-credit plugin):
# the answer's u32 array is then `pack_tier_runs`'s, not one u32 per row
FLAG_TIERS = 2
MAX_SECTIONS = 8  # block sizes per lookup (kvindex allows 4 per worker; a pool rarely has 2)
MAX_LOOKUP_HASHES = 1 << 17  # per section: 4M tokens at block size 32; more is cut (a lookup stays bounded)
MAX_FILTER_BYTES = 1 << 20
SEQPACKET_BUFFER = 4 << 20  # SO_SNDBUF/SO_RCVBUF of both ends: the largest message must fit one datagram

# control frames: length (of type + body), type
_FRAME = struct.Struct("<IB")
MAX_FRAME = 64 << 20
T_HELLO = ord("H")  # JSON {"client": id}: who is talking (a reconnecting picker replaces its own set)
# JSON [[address, [[endpoint, replay | null, rank | null, storage], ...]], ...]: the full set; `storage` true
# marks llm-d's file-system connector stream (`KvSource.storage`), absent or false a GPU event stream
T_WORKERS = ord("W")
T_BLOCK_SIZE = ord("B")  # JSON [address, n]
T_RESYNC = ord("R")  # JSON address
T_PREDICT = ord("P")  # binary: see pack_prediction
T_SNAPSHOT = ord("S")  # JSON {"id": n} -> T_SNAPSHOT_ANSWER JSON {"id": n, "snapshot": {...}}
T_SNAPSHOT_ANSWER = ord("s")
T_META = ord("M")  # shard -> pickers, whenever the worker table changes: u32 version, then the meta JSON
_PRED = struct.Struct("<HIfdI")  # address length, block size, ttl_s, sender's wall clock, number of hashes


def shard_of(address: str, shards: int, stores: Mapping[str, str] | None = None) -> int:
    """The ingest shard that owns a worker: stable across processes and restarts (not Python's hash).

    A worker that mounts a shared store (`stores`, `--kv-shared-stores`: address -> store) belongs to the
    store's shard, not its address's: a store's chunks are resolved through its members' GPU events and
    credited to every member (kvindex/index.py `_Store`, `_expand_shared`), so all its members must be in one
    index. The picker and every shard are given the same `stores`, so they agree on the owner."""
    if shards <= 1:
        return 0
    store = stores.get(address) if stores else None
    key = address if store is None else "\0store:" + store  # no address starts with NUL
    return xxhash.xxh3_64_intdigest(key.encode()) % shards


def lookup_socket(directory: str, shard: int) -> str:
    return f"{directory}/ingest-{shard}.lookup"


def control_socket(directory: str, shard: int) -> str:
    return f"{directory}/ingest-{shard}.ctl"


@dataclass(slots=True)
class LookupRequest:
    req_id: int
    meta_version: int
    predicted: bool
    sections: list[tuple[int, array]]  # (block size, hashes as array('Q'))
    workers: list[str] | None  # None: every worker of the shard
    tiers: bool = False  # FLAG_TIERS: answer tier runs (`pack_tier_runs`), not one count per row


def pack_lookup(req_id: int, meta_version: int, predicted: bool, sections: Sequence[tuple[int, Sequence[int]]],
                workers: Sequence[str] | None = None, *, tiers: bool = False) -> bytes:
    """One lookup request: a header, then per block size its hashes, then the optional worker filter."""
    filt = "\n".join(workers).encode() if workers is not None else b""
    flags = (FLAG_PREDICTED if predicted else 0) | (FLAG_TIERS if tiers else 0)
    parts = [_REQ.pack(OP_LOOKUP, req_id, meta_version, flags, len(sections),
                       len(filt) if workers is not None else 0xFFFFFFFF)]
    for bs, hashes in sections:
        arr = pack_u64(hashes)
        parts.append(_SECTION.pack(bs, len(arr)))
        parts.append(arr.tobytes())
    parts.append(filt)
    return b"".join(parts)


def unpack_lookup(buf: bytes) -> LookupRequest:
    """Parse a lookup; ValueError on anything malformed or over the bounds (the server answers nothing)."""
    try:
        op, req_id, version, flags, n_sections, n_filter = _REQ.unpack_from(buf, 0)
    except struct.error:
        raise ValueError("short lookup header") from None
    if op != OP_LOOKUP or n_sections > MAX_SECTIONS:
        raise ValueError("not a lookup")
    off = _REQ.size
    sections = []
    for _ in range(n_sections):
        try:
            bs, n = _SECTION.unpack_from(buf, off)
        except struct.error:
            raise ValueError("short section header") from None
        off += _SECTION.size
        end = off + 8 * n
        if bs <= 0 or end > len(buf):
            raise ValueError("bad section")
        arr = array("Q")
        arr.frombytes(buf[off : min(end, off + 8 * MAX_LOOKUP_HASHES)])
        sections.append((bs, arr))
        off = end
    workers = None
    if n_filter != 0xFFFFFFFF:
        if n_filter > MAX_FILTER_BYTES or off + n_filter != len(buf):
            raise ValueError("bad worker filter")
        workers = buf[off:].decode().split("\n") if n_filter else []
    return LookupRequest(req_id, version, bool(flags & FLAG_PREDICTED), sections, workers, bool(flags & FLAG_TIERS))


def pack_answer(req_id: int, meta_version: int, meta: bytes | None, counts: array | np.ndarray,
                service_s: float = 0.0, batch_lag_s: float = math.nan) -> bytes:
    """The answer: `counts` is array('I') or a uint32 array, the blocks held by the worker of each row; `meta`
    only when it changed; `service_s` and `batch_lag_s` as `answer_figures` reads them."""
    m = meta or b""
    return b"".join((_ANS.pack(OP_ANSWER, req_id, meta_version, len(m), len(counts), service_s, batch_lag_s), m,
                     counts.tobytes()))


def answer_figures(buf: bytes) -> tuple[float, float | None]:
    """(the shard's service time on the lookup, how old its newest applied event batch was when applied, or
    None before any) of an answer `unpack_answer` accepted: read only for a traced request."""
    service_s, lag_s = _ANS.unpack_from(buf, 0)[5:]
    return service_s, None if math.isnan(lag_s) else lag_s


def unpack_answer(buf: bytes) -> tuple[int, int, bytes | None, array]:
    """(request id, meta version, meta JSON or None, array('I') of the blocks held per row)."""
    op, req_id, version, n_meta, n, _, _ = _ANS.unpack_from(buf, 0)
    if op != OP_ANSWER:
        raise ValueError("not an answer")
    off = _ANS.size
    meta = bytes(buf[off : off + n_meta]) if n_meta else None
    off += n_meta
    if len(buf) != off + 4 * n:
        raise ValueError("answer of the wrong length")
    counts = array("I")
    counts.frombytes(buf[off:])
    return req_id, version, meta, counts


def pack_tier_runs(runs: Mapping[int, Sequence[tuple[int, int]]]) -> array:
    """A tiers lookup's answer array (`FLAG_TIERS`): per row holding anything, `row, k`, then its `k` runs as
    `code, n` (`KvIndex.overlap_tiers`: `n` leading positions at the tiers in `code`). Runs, not per-tier
    counts: which tier a position is credited at depends on the weights, which only the picker's plugin knows;
    a worker's runs are a handful however long its prefix (one per change of tiers), so the answer stays small."""
    out = array("I")
    for row, rs in runs.items():
        out.append(row)
        out.append(len(rs))
        for code, n in rs:
            out.append(code)
            out.append(n)
    return out


def unpack_tier_runs(flat: Sequence[int]) -> dict[int, tuple[tuple[int, int], ...]]:
    """`pack_tier_runs`' array back to row -> runs; ValueError when it does not parse whole."""
    out: dict[int, tuple[tuple[int, int], ...]] = {}
    i, n = 0, len(flat)
    while i < n:
        if i + 2 > n:
            raise ValueError("short tier runs")
        row, k = flat[i], flat[i + 1]
        end = i + 2 + 2 * k
        if end > n:
            raise ValueError("short tier runs")
        out[row] = tuple((flat[j], flat[j + 1]) for j in range(i + 2, end, 2))
        i = end
    return out


@dataclass(slots=True)
class Meta:
    """A shard's worker table as a picker mirrors it: the index of each worker in answers, its block size,
    whether its index is warm (first batch in), and the block sizes present in the shard's index."""

    version: int = 0
    workers: tuple[str, ...] = ()
    block_sizes: dict[str, int] | None = None
    warm: frozenset[str] = frozenset()
    sizes: tuple[int, ...] = ()
    dialects: dict[str, str] | None = None  # how each worker's engine keys media blocks, once learned
    tiers: bool = False  # the shard's index holds a block off the GPU: a tiers lookup is worth sending

    @staticmethod
    def decode(version: int, raw: bytes) -> Meta:
        d = orjson.loads(raw)
        rows = d["workers"]
        return Meta(version, tuple(r[0] for r in rows), {r[0]: r[1] for r in rows if r[0]},
                    frozenset(r[0] for r in rows if r[2]), tuple(d["sizes"]),
                    {r[0]: r[3] for r in rows if r[0] and len(r) > 3 and r[3]}, bool(d.get("tiers")))


def encode_meta(rows: Sequence[tuple[str, int, bool, str | None]], sizes: Sequence[int], tiers: bool = False) -> bytes:
    return orjson.dumps({"workers": [list(r) for r in rows], "sizes": list(sizes), "tiers": tiers})


def frame(kind: int, body: bytes) -> bytes:
    return _FRAME.pack(len(body) + 1, kind) + body


FRAME_HEADER = _FRAME.size


def frame_header(buf: bytes) -> tuple[int, int]:
    """(body length, type) of a control frame header; ValueError when over MAX_FRAME."""
    n, kind = _FRAME.unpack(buf)
    if n < 1 or n > MAX_FRAME:
        raise ValueError(f"control frame of {n} bytes")
    return n - 1, kind


def pack_prediction(address: str, block_size: int, ttl_s: float, sent_wall: float, hashes: Sequence[int]) -> bytes:
    """A prediction: the worker, the block size its hashes were made in, lifetime, when it was made."""
    a = address.encode()
    arr = pack_u64(hashes)
    return _PRED.pack(len(a), block_size, ttl_s, sent_wall, len(arr)) + a + arr.tobytes()


def unpack_prediction(body: bytes, max_hashes: int) -> tuple[str, int, float, float, array]:
    n_addr, bs, ttl, sent, n = _PRED.unpack_from(body, 0)
    off = _PRED.size
    address = body[off : off + n_addr].decode()
    off += n_addr
    arr = array("Q")
    arr.frombytes(body[off : off + 8 * min(n, max_hashes)])
    return address, bs, ttl, sent, arr
