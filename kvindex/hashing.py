"""The project's own chained block hash, shared by the request path and the event path.

Both sides hash token ids themselves, so a request and an engine event agree by construction whatever the
engine's internal hash algorithm is.  Per full block: xxh3-64 over the block's token ids as little-endian u32.
The first block is seeded with ``1337 + xxh3_64(lora_name, seed=0) + xxh3_64(salt, seed=1)`` (wrap-around u64,
terms only when present); every later block is seeded with its parent's hash.  Seeding with the parent makes
the chain cost one xxh3 call per block (no concatenation, no second hash) while equal values still mean equal
prefixes under equal LoRA/salt.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache

import xxhash

MASK64 = 0xFFFFFFFFFFFFFFFF
BASE_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"


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


def chain_hashes(packed: array, n_tokens: int, block_size: int, seed: int) -> list[int]:
    """Chained hashes of the full blocks within the first ``n_tokens`` of an already packed prompt."""
    step = block_size * 4
    end = (n_tokens // block_size) * step
    mv = memoryview(packed).cast("B")
    out: list[int] = []
    append = out.append
    h = seed
    for off in range(0, end, step):
        h = _xxh3(mv[off : off + step], h)
        append(h)
    return out


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
