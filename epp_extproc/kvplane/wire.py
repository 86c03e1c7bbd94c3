"""The KV event plane's wire: NATS subjects, the live message envelope, dump chunks and relay heartbeats.

Why a wire of our own inside NATS at all: a NATS message carries bytes, and a picker must know, for each
message, which worker it is about, which relay instance (``epoch``) numbered it and where it sits in that
relay's stream for the worker (``seq``), so that it can apply today's gap and restart rules to the plane
itself. The engine's payload travels untouched (the picker decodes it with kvindex's decoder, every dialect),
so the plane adds a fixed 29-byte header and the worker id, nothing else.

Everything here parses hostile input: a parse either returns a fully checked value or ``None`` (live
messages, heartbeats) / raises :class:`Malformed` (dumps), never anything else, and every size is bounded
before anything is allocated for it (msgpack's own ``max_*_len`` limits on dumps and heartbeats).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

LIVE_MAGIC = b"KVP1"
DUMP_MAGIC = b"KVD1"
HEARTBEAT_MAGIC = b"KVH1"
KIND_BATCH = 0  # an engine batch the relay applied: the payload is the engine's msgpack, untouched
KIND_CLEAR = 1  # the relay cleared the stream's rank (rank -1: the whole worker): lost state, a gap, a restart
_LIVE = struct.Struct(">4sBhQQQH")  # magic, kind, rank (-1 none), epoch, plane seq, engine seq, worker id length
LIVE_HEADER = _LIVE.size
MAX_WORKER_ID = 512  # bytes of a worker id (an address, or a name): far above any real one
MAX_DUMP_CHUNKS = 4096  # chunks of one dump: 4096 x 1 MB (NATS's default max payload) = 4 GB, past any cap
MAX_DUMP_SLOTS = 1024  # (rank, block size) slots in one chunk
MAX_HEARTBEAT_WORKERS = 8192  # workers one relay may announce in one heartbeat
MAX_RANK = 1 << 12
MAX_BLOCK_SIZE = 1 << 16
U64 = (1 << 64) - 1
_TOKEN_BAD = re.compile(r"[^A-Za-z0-9_-]")
# the relays' heartbeats share the events' subject space (``<prefix>.<pool>.ev._hb``) so that one subscription
# gets both in the order each relay sent them; a worker token always ends in "-<hash>", so it never is this
HEARTBEAT_TOKEN = "_hb"


class Malformed(ValueError):
    """A message on the plane's subjects failed validation: counted and refused, like a malformed frame."""


def worker_token(worker_id: str) -> str:
    """The subject token of a worker: NATS tokens cannot hold ``.``, ``*``, ``>`` or spaces and addresses do
    (``10.0.0.1:8000``), so the id is made safe and suffixed with a hash of the real id (two ids made the same
    by the substitution still get different subjects). The real id travels in every message, and is checked."""
    safe = _TOKEN_BAD.sub("_", worker_id)[:64]
    return f"{safe}-{xxhash.xxh3_64_hexdigest(worker_id.encode())[:12]}"


@dataclass(frozen=True, slots=True)
class Subjects:
    """The subjects of one pool: a picker subscribes to ``events_all`` once for the whole pool (one NATS
    subscription, whatever the number of workers), asks ``dump(worker)`` for a snapshot, and listens to
    ``heartbeat`` to learn which relays are alive and how far each worker's stream has gone."""

    prefix: str = "epp.kv"
    pool: str = "default"

    def __post_init__(self) -> None:
        for part in (*self.prefix.split("."), self.pool):
            if not part or _TOKEN_BAD.search(part):
                raise ValueError(f"subject part {part!r}: letters, digits, '_' and '-' only")

    def events(self, worker_id: str) -> str:
        return f"{self.prefix}.{self.pool}.ev.{worker_token(worker_id)}"

    @property
    def events_all(self) -> str:
        return f"{self.prefix}.{self.pool}.ev.*"

    def dump(self, worker_id: str) -> str:
        return f"{self.prefix}.{self.pool}.dump.{worker_token(worker_id)}"

    @property
    def heartbeat(self) -> str:
        return f"{self.prefix}.{self.pool}.ev.{HEARTBEAT_TOKEN}"


@dataclass(frozen=True, slots=True)
class LiveMessage:
    kind: int
    rank: int | None
    epoch: int
    seq: int
    engine_seq: int
    worker_id: str
    payload: bytes


def encode_live(kind: int, rank: int | None, epoch: int, seq: int, engine_seq: int, worker_id: str,
                payload: bytes = b"") -> bytes:
    wid = worker_id.encode()
    return _LIVE.pack(LIVE_MAGIC, kind, -1 if rank is None else rank, epoch, seq, engine_seq & U64,
                      len(wid)) + wid + payload


def parse_live(data: bytes, max_payload: int) -> LiveMessage | None:
    """One live message, or None when it is not one (wrong magic, kind, rank, sizes, a clear with a payload,
    a worker id that is not UTF-8). ``max_payload``: the picker's ``max_batch_bytes``, as for a ZeroMQ frame."""
    if len(data) < LIVE_HEADER:
        return None
    magic, kind, rank, epoch, seq, engine_seq, n = _LIVE.unpack_from(data)
    if magic != LIVE_MAGIC or kind not in (KIND_BATCH, KIND_CLEAR) or not -1 <= rank < MAX_RANK:
        return None
    if n == 0 or n > MAX_WORKER_ID or len(data) < LIVE_HEADER + n:
        return None
    payload = data[LIVE_HEADER + n:]
    if len(payload) > max_payload or (kind == KIND_CLEAR and payload) or (kind == KIND_BATCH and not payload):
        return None
    try:
        wid = data[LIVE_HEADER:LIVE_HEADER + n].decode()
    except UnicodeDecodeError:
        return None
    return LiveMessage(kind, None if rank < 0 else rank, epoch, seq, engine_seq, wid, bytes(payload))


# ----------------------------------------------------------------------------------------------- dumps
@dataclass(slots=True)
class DumpSlot:
    """One (rank, block size) slot of a worker: engine hashes and the index's own chained hashes, paired, in
    the slot's eviction order (oldest first), each packed as native u64 arrays' bytes (8 bytes a hash)."""

    rank: int
    block_size: int
    engine: bytes
    ours: bytes


@dataclass(slots=True)
class DumpChunk:
    worker_id: str
    epoch: int
    seq: int
    index: int
    count: int
    block_size: int
    size_source: str
    slots: list[DumpSlot]
    dialect: str | None = None  # how the worker's engine keys media blocks (kvindex.hashing DIALECT_*), if seen
    # per rank (None: a worker of one rank), the engine's seq of the last batch the dump's state contains: a
    # picker that loaded it can tell, at a relay restart, whether the new relay's stream continues the same
    # engine's (`PlaneSubscribers`' carry). Absent from a relay of an earlier release: then nothing is known.
    engine_seqs: dict[int | None, int] = field(default_factory=dict)
    # per rank, the engine's seq of the first batch in the dump's state (the relay's start, or its last clear of
    # the rank; a rank missing: nothing since): where the relay's history begins. A picker holding entries from
    # before it (an earlier relay's stream, its direct events) loads the dump on top of them
    # (`PlaneSubscribers._merges`). None: a relay of an earlier release, which does not say.
    first_seqs: dict[int | None, int] | None = None


def encode_dump_request(worker_id: str) -> bytes:
    return msgpack.packb({"v": 1, "w": worker_id})


def parse_dump_request(data: bytes) -> str | None:
    try:
        obj = msgpack.unpackb(data, max_str_len=MAX_WORKER_ID, max_bin_len=0, max_array_len=0, max_map_len=4)
    except Exception:
        return None
    if not isinstance(obj, dict) or obj.get("v") != 1 or not isinstance(obj.get("w"), str):
        return None
    return str(obj["w"])


def encode_dump_chunk(c: DumpChunk) -> bytes:
    return DUMP_MAGIC + msgpack.packb({
        "v": 1, "w": c.worker_id, "e": c.epoch, "s": c.seq, "i": c.index, "n": c.count, "bs": c.block_size,
        "src": c.size_source, "d": c.dialect, "slots": [[s.rank, s.block_size, s.engine, s.ours] for s in c.slots],
        "es": _seq_pairs(c.engine_seqs), **({} if c.first_seqs is None else {"fs": _seq_pairs(c.first_seqs)})},
        use_bin_type=True)


def _seq_pairs(seqs: dict[int | None, int]) -> list[list[int]]:
    return [[-1 if r is None else r, q & U64] for r, q in seqs.items()]


def _int(obj: dict, key: str, lo: int, hi: int) -> int:
    v = obj.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise Malformed(f"dump field {key!r}: {v!r}")
    return v


def parse_dump_chunk(data: bytes, max_bytes: int) -> DumpChunk:
    """One chunk of a dump, fully checked: raises :class:`Malformed` otherwise."""
    if len(data) > max_bytes or not data.startswith(DUMP_MAGIC):
        raise Malformed("not a dump chunk (magic or size)")
    try:
        obj = msgpack.unpackb(data[len(DUMP_MAGIC):], raw=False, max_str_len=MAX_WORKER_ID,
                              max_bin_len=max_bytes, max_array_len=MAX_DUMP_SLOTS, max_map_len=16,
                              strict_map_key=True)
    except Exception as exc:
        raise Malformed(f"dump chunk does not decode: {exc}") from None
    if not isinstance(obj, dict) or obj.get("v") != 1:
        raise Malformed("dump chunk: not a version-1 map")
    wid, src, raw_slots = obj.get("w"), obj.get("src"), obj.get("slots")
    if not isinstance(wid, str) or not wid or src not in ("default", "configured", "events"):
        raise Malformed("dump chunk: worker id or size source")
    count = _int(obj, "n", 1, MAX_DUMP_CHUNKS)
    chunk = DumpChunk(wid, _int(obj, "e", 0, U64), _int(obj, "s", 0, U64), _int(obj, "i", 0, count - 1), count,
                      _int(obj, "bs", 1, MAX_BLOCK_SIZE), src, [])
    if not isinstance(raw_slots, list):
        raise Malformed("dump chunk: slots")
    dialect = obj.get("d")
    if dialect is not None and (not isinstance(dialect, str) or len(dialect) > 32):
        raise Malformed("dump chunk: dialect")
    chunk.dialect = dialect
    chunk.engine_seqs = _engine_seqs(obj.get("es"))
    chunk.first_seqs = None if obj.get("fs") is None else _engine_seqs(obj["fs"])
    for s in raw_slots:
        if (not isinstance(s, list) or len(s) != 4 or type(s[0]) is not int or type(s[1]) is not int
                or not isinstance(s[2], bytes) or not isinstance(s[3], bytes)):
            raise Malformed("dump chunk: a slot is not [rank, block_size, engine, ours]")
        rank, bs, eng, ours = s
        if not 0 <= rank < MAX_RANK or not 1 <= bs <= MAX_BLOCK_SIZE or len(eng) != len(ours) or len(eng) % 8:
            raise Malformed("dump chunk: slot bounds or hash arrays")
        chunk.slots.append(DumpSlot(rank, bs, eng, ours))
    return chunk


def _engine_seqs(raw: object) -> dict[int | None, int]:
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise Malformed("dump chunk: engine seqs")
    out: dict[int | None, int] = {}
    for pair in raw:
        if (not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) is not int or type(pair[1]) is not int
                or not -1 <= pair[0] < MAX_RANK or not 0 <= pair[1] <= U64):
            raise Malformed("dump chunk: an engine seq is not [rank, seq]")
        out[None if pair[0] < 0 else pair[0]] = pair[1]
    return out


# ------------------------------------------------------------------------------------------ heartbeats
@dataclass(frozen=True, slots=True)
class Heartbeat:
    relay: str
    epoch: int
    workers: dict[str, int]  # worker id -> the last seq the relay published for it
    bye: bool = False  # the relay's last word as it stops: pickers take the next relay's stream as its restart


def encode_heartbeat(hb: Heartbeat) -> bytes:
    obj: dict[str, Any] = {"v": 1, "r": hb.relay, "e": hb.epoch, "w": hb.workers}
    if hb.bye:
        obj["bye"] = True
    return HEARTBEAT_MAGIC + msgpack.packb(obj)


def parse_heartbeat(data: bytes, max_bytes: int) -> Heartbeat | None:
    if len(data) > max_bytes or not data.startswith(HEARTBEAT_MAGIC):
        return None
    try:
        obj = msgpack.unpackb(data[len(HEARTBEAT_MAGIC):], max_str_len=MAX_WORKER_ID, max_bin_len=0,
                              max_array_len=0, max_map_len=MAX_HEARTBEAT_WORKERS)
    except Exception:
        return None
    if not isinstance(obj, dict) or obj.get("v") != 1:
        return None
    relay, epoch, workers = obj.get("r"), obj.get("e"), obj.get("w")
    if not isinstance(relay, str) or type(epoch) is not int or not 0 <= epoch <= U64 or not isinstance(workers, dict):
        return None
    for k, v in workers.items():
        if not isinstance(k, str) or type(v) is not int or not 0 <= v <= U64:
            return None
    return Heartbeat(relay, epoch, workers, obj.get("bye") is True)
