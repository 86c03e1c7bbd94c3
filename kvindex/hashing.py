"""The project's own chained block hash, shared by the request path and the event path.

Both sides hash token ids themselves, so a request and an engine event agree by construction whatever the
engine's internal hash algorithm is.  Per full block: xxh3-64 over the block's token ids as little-endian u32.
The first block is seeded with ``1337 + xxh3_64(lora_name, seed=0) + xxh3_64(salt, seed=1)`` (wrap-around u64,
terms only when present); every later block is seeded with its parent's hash.  Seeding with the parent makes
the chain cost one xxh3 call per block (no concatenation, no second hash) while equal values still mean equal
prefixes under equal LoRA/salt.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Protocol

import xxhash

from kvindex import native

MASK64 = 0xFFFFFFFFFFFFFFFF
BASE_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"


_native_pack = native.MODULE.pack_u32 if native.MODULE is not None else None
_native_pack64 = native.MODULE.pack_u64 if native.MODULE is not None else None
_ZERO_U32 = array("I", [0])
_ZERO_U64 = array("Q", [0])


def pack_u64(values: Sequence[int]) -> array:
    """Block hashes as an ``array('Q')`` (native byte order: what the ingest wire carries), the same values and
    errors as ``array('Q', values)``; an ``array('Q')`` is taken as it is. A list goes through the accelerator
    when it is built: ``array('Q', list)`` converts each 64-bit int byte by byte (0.2M instructions for a
    32k-token prompt's 1,023 hashes, which a decision sends twice: its lookup and its prediction)."""
    if isinstance(values, array) and values.typecode == "Q":
        return values
    if type(values) is list and _native_pack64 is not None:
        arr = _ZERO_U64 * len(values)
        _native_pack64(values, arr)
        return arr
    return array("Q", values)


@lru_cache(maxsize=1024)
def root_seed(lora_name: str | None = None, salt: str | None = None) -> int:
    """Seed of the first block of a chain; cached because there are few distinct LoRA/salt values."""
    seed = BASE_SEED
    if lora_name:
        seed += _xxh3(lora_name.encode(), 0)
    if salt:
        seed += _xxh3(salt.encode(), 1)
    return seed & MASK64


def pack_tokens(token_ids: Sequence[int]) -> array:
    """Pack token ids once as little-endian u32 (raises OverflowError/TypeError on invalid ids).

    An ``array('I')`` given in is reused as is: callers that keep prompts packed pay nothing here.
    """
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        arr = token_ids
    elif type(token_ids) is list:  # what a parsed render answer is: fromlist takes it at about half the cost
        if _native_pack is not None:  # the accelerator's loop: a fifth of fromlist's cost, the same ids and errors
            arr = _ZERO_U32 * len(token_ids)
            _native_pack(token_ids, arr)
        else:
            arr = array("I")
            arr.fromlist(token_ids)
    else:
        arr = array("I", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms only
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        arr = array("I", arr)
        arr.byteswap()
    return arr


@lru_cache(maxsize=64)
def _cutter(step: int) -> Callable[[memoryview], Iterator[tuple[bytes]]]:
    return struct.Struct(f"{step}s").iter_unpack


def block_chunks(packed: array, n_blocks: int, block_size: int) -> Iterator[tuple[bytes]]:
    """The first ``n_blocks`` full blocks of a packed prompt, one 1-tuple of bytes per block, cut in C
    (`struct.iter_unpack`): a memoryview slice per block cost 38% more of a chain's hashing."""
    step = block_size * 4
    return _cutter(step)(memoryview(packed).cast("B")[: n_blocks * step])


def chain_hashes_py(packed: array, n_tokens: int, block_size: int, seed: int) -> list[int]:
    """Chained hashes of the full blocks within the first ``n_tokens`` of an already packed prompt (pure
    Python; :func:`chain_hashes` is this or the C accelerator's, byte-identical)."""
    out: list[int] = []
    append = out.append
    h = seed
    for (chunk,) in block_chunks(packed, n_tokens // block_size, block_size):
        h = _xxh3(chunk, h)
        append(h)
    return out


def chain_blocks_py(packed: array, n_blocks: int, block_size: int, seed: int) -> list[int]:
    """Chained hashes of the first ``n_blocks`` full blocks of a packed prompt (the index's form of
    :func:`chain_hashes`: it counts blocks, not tokens); pure Python, :func:`chain_blocks` is this or the C
    accelerator's."""
    out: list[int] = []
    append = out.append
    h = seed
    for (chunk,) in block_chunks(packed, n_blocks, block_size):
        h = _xxh3(chunk, h)
        append(h)
    return out


if native.MODULE is not None:
    _native_chain = native.MODULE.chain
    chain_blocks: Callable[[array, int, int, int], list[int]] = _native_chain

    def chain_hashes(packed: array, n_tokens: int, block_size: int, seed: int) -> list[int]:
        """Chained hashes of the full blocks within the first ``n_tokens`` of an already packed prompt: one C
        call for the whole chain (kvindex/native.py), the same values as :func:`chain_hashes_py`."""
        return _native_chain(packed, n_tokens // block_size, block_size, seed)
else:
    chain_blocks = chain_blocks_py
    chain_hashes = chain_hashes_py


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    salt: str | None = None,
) -> list[int]:
    """Chained hashes of each FULL block of ``token_ids`` (a partial tail block is ignored)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n_full = (len(token_ids) // block_size) * block_size
    if n_full == 0:
        return []
    if not isinstance(token_ids, array):
        token_ids = token_ids[:n_full]
    return chain_hashes(pack_tokens(token_ids), n_full, block_size, root_seed(lora_name, salt))


# ----------------------------------------------------------------------------------------------- media blocks
# A block that multimodal items overlap is keyed by its tokens AND the items' keys, exactly as the engine keys it
# (the placeholder tokens alone are the same for every image).  The items' keys of one block are encoded once,
# canonically, into bytes (`mm_*_key` below); the block is then hashed with a seed derived from its parent and
# those bytes: ``h = xxh3(tokens, seed=xxh3(mm_bytes, seed=parent))``.  A text-only block keeps today's
# ``xxh3(tokens, seed=parent)``, so text-only chains (and every figure built on them) are unchanged, and a block
# with media keys can only equal a text-only block by a 64-bit collision.  The same encoding runs on the event
# side (decoded per-block keys, kvindex/decode.py) and on the request side (the render's items, below).
#
# Dialects: how an engine version keys an item in a block (what the worker's events show):
#   vllm       (identifier, offset) per overlapping item, offset = item start - block start (negative when the
#              item began in an earlier block): vLLM 0.32.0 (vllm/v1/core/kv_cache_utils.py
#              `_gen_mm_extra_hash_keys`, published untagged by `to_event_extra_keys`) and vllm-project/vllm
#              commit 001cabc1be16a59a70d720ed61a13b678c060a18;
#   vllm-bare  the bare identifier per overlapping item (older vLLM: `extra_keys.append(mm_feature.identifier)`);
#   trtllm     TensorRT-LLM `MmKey` (32-byte hash, start offset of the block inside the item, optional uuid):
#              NVIDIA/TensorRT-LLM cpp/tensorrt_llm/batch_manager/blockKey.cpp `generateBlockHashExtraKeys`
#              (commit 2bb816c6ee6c9e2a5e00f62cd36228eb8fe479aa).  Its render refuses media and its events' token
#              ids for media blocks are the engine's own (not the rendered placeholders), so a request cannot
#              rebuild them: the request side stops its chain at the first media block (text before it counts).
DIALECT_VLLM = "vllm"
DIALECT_VLLM_BARE = "vllm-bare"
DIALECT_TRTLLM = "trtllm"
DIALECTS = (DIALECT_VLLM, DIALECT_VLLM_BARE, DIALECT_TRTLLM)
DEFAULT_DIALECT = DIALECT_VLLM  # the request side's key shape for a worker whose events showed none yet

_PAIR, _BARE, _TRT, _UUID = b"\x01", b"\x02", b"\x03", b"\x04"


def _lp(b: bytes) -> bytes:
    """Length-prefixed bytes: no concatenation of two keys can read as another pair of keys."""
    return len(b).to_bytes(4, "little") + b


def _off(n: int) -> bytes:
    return (n & MASK64).to_bytes(8, "little")


def mm_pair_key(items: Sequence[tuple[str, int]]) -> bytes:
    """vLLM 0.32 dialect: one block's ``(identifier, offset)`` pairs, in engine order."""
    return b"".join(_PAIR + _lp(i.encode()) + _off(o) for i, o in items)


def mm_bare_key(ids: Sequence[str]) -> bytes:
    """Older vLLM dialect: one block's bare string keys, in engine order."""
    return b"".join(_BARE + _lp(i.encode()) for i in ids)


def mm_trtllm_key(keys: Sequence[tuple[bytes, int, str | None]]) -> bytes:
    """TensorRT-LLM dialect: one block's ``(hash, start_offset, uuid)`` keys, in engine order."""
    return b"".join(_TRT + _lp(h) + _off(o) + (_UUID + _lp(u.encode()) if u is not None else b"")
                    for h, o, u in keys)


def mm_seed(parent: int, mm_key: bytes) -> int:
    """The seed a media block's tokens are hashed with: its parent's hash folded with the block's item keys."""
    return _xxh3(mm_key, parent)


def chain_hashes_with_keys(packed: array, block_size: int, seed: int, keys: Sequence[bytes | None]) -> list[int]:
    """The event side: chained hashes of ``len(keys)`` full blocks whose media keys (canonical bytes, None for a
    text-only block) were decoded from the engine's event."""
    step = block_size * 4
    mv = memoryview(packed).cast("B")
    out: list[int] = []
    h = seed
    for i, k in enumerate(keys):
        if k is not None:
            h = _xxh3(k, h)
        h = _xxh3(mv[i * step : (i + 1) * step], h)
        out.append(h)
    return out


class MediaSpan(Protocol):
    """What the request side needs of a multimodal item (core/contract.MediaItem is one)."""

    @property
    def identifier(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


def media_chain_hashes(
    packed: array, n_tokens: int, block_size: int, lora_name: str | None, salt: str | None,
    media: Sequence[MediaSpan], dialect: str = DEFAULT_DIALECT,
) -> list[int]:
    """Chained hashes of the full blocks within the first ``n_tokens`` of a packed prompt whose ``media`` items
    (in prompt order, spans from the render) key the blocks they overlap the way ``dialect``'s engine does.

    O(blocks + items).  Blocks no item overlaps are hashed exactly like :func:`chain_hashes`.  Items that are
    out of order, overlap each other or have an empty/negative span end the chain before the first block they
    touch (never guess a key); so does the first media block in the TensorRT-LLM dialect (see above).
    """
    nblocks = n_tokens // block_size
    step = block_size * 4
    mv = memoryview(packed).cast("B")
    out: list[int] = []
    append = out.append
    # validate once: sorted, non-overlapping, non-empty spans; the chain stops where the first bad one begins
    stop = nblocks
    prev_start = prev_end = 0
    for it in media:
        if it.length <= 0 or it.offset < prev_end:  # the chain ends before either item of a bad pair begins
            stop = min(stop, max(0, min(it.offset, prev_start if prev_end else it.offset)) // block_size)
            break
        prev_start, prev_end = it.offset, it.offset + it.length
    bare = dialect == DIALECT_VLLM_BARE
    if dialect == DIALECT_TRTLLM and media:
        stop = min(stop, media[0].offset // block_size)
    tag = _BARE if bare else _PAIR
    heads = [tag + _lp(it.identifier.encode()) for it in media]  # each item's key bytes, encoded once
    h = root_seed(lora_name, salt)
    j = 0
    n_items = len(media)
    b = 0
    while b < stop:
        s = b * block_size
        e = s + block_size
        while j < n_items and media[j].offset + media[j].length <= s:
            j += 1
        if (j == n_items or media[j].offset >= e) and not (b == 0 and bare and salt):
            # a run of text-only blocks up to the next item: hashed exactly like chain_hashes
            nxt = stop if j == n_items else min(stop, media[j].offset // block_size)
            for off in range(b * step, nxt * step, step):
                h = _xxh3(mv[off : off + step], h)
                append(h)
            b = nxt
            continue
        k = j
        while k < n_items and media[k].offset < e:
            k += 1
        if b == 0 and bare:
            # the salt and the items' bare ids share one list of strings in this dialect, so the event side
            # cannot tell a lone id from a lone salt: both sides read one string as the salt, more as keys
            # (kvindex/decode.py `_identity`); vLLM itself hashes the two cases alike
            strings = [media[i].identifier for i in range(j, k)] + ([salt] if salt else [])
            if len(strings) == 1:
                h = root_seed(lora_name, strings[0])
            elif strings:
                h = mm_seed(root_seed(lora_name, None), mm_bare_key(strings))
        elif k == j + 1:  # the usual media block: inside one item
            h = _xxh3(heads[j] if bare else heads[j] + ((media[j].offset - s) & MASK64).to_bytes(8, "little"), h)
        elif bare:
            h = _xxh3(b"".join(heads[j:k]), h)
        else:
            h = _xxh3(b"".join(heads[i] + _off(media[i].offset - s) for i in range(j, k)), h)
        h = _xxh3(mv[b * step : e * 4], h)  # (the three branches above are mm_seed, inlined)
        append(h)
        b += 1
    return out
