"""The building blocks of the benchmarks' cached-token oracles, under the mock's reuse rules.

A prompt's blocks are a hash chain of its full blocks; only the blocks within ``prompt[:-1]`` can be reused.
bench_routing's oracle (group affinity) and trace_workload's (pooled cache) differ only in which cache they
ask, so both are built from these three pieces.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence


def block_chain(tokens: Sequence[int], bs: int) -> list[int]:
    """One hash per full block, each over its parent's hash too: equal hashes mean equal prefixes."""
    out, h = [], 0
    for i in range(len(tokens) // bs):
        h = hash((h, tuple(tokens[i * bs:(i + 1) * bs])))
        out.append(h)
    return out


def cached_tokens(tokens: Sequence[int], chain: Sequence[int], cache: Container[int], bs: int) -> int:
    """Tokens a cache holding `cache`'s blocks would serve: the leading run of the chain it holds, counted only
    within ``tokens[:-1]`` (an engine always computes the last token)."""
    reusable = (len(tokens) - 1) // bs
    k = 0
    while k < reusable and chain[k] in cache:
        k += 1
    return k * bs


def lru_store(cache: OrderedDict[int, None], chain: Sequence[int], capacity: int) -> None:
    """Store the chain as the most recently used blocks, then evict the oldest down to `capacity` blocks."""
    for h in chain:
        cache[h] = None
        cache.move_to_end(h)
    while len(cache) > capacity:
        cache.popitem(last=False)
