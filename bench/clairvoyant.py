"""A clairvoyant router for the trace benchmark: what placement could reach if it knew the future (issue 28.2).

The (d) oracle kept beside it (``pooled_lru``) is one LRU cache with the capacity of all workers together: no
block stored twice, nothing held by in-flight requests. That is optimistic in one way (no reservations, no
duplication) and naive in another (LRU, not the best eviction), so "(c) reaches 89% of it" did not say how
much a better router could still win. This module replays the same prompts against the mock's per-worker
capacity model and places each request with knowledge no online router has:

* **Future knowledge.** Every later request's prompt is known, so eviction on each worker is Belady's rule:
  the unpinned cached block whose next use (by any later request, on any worker) is farthest away goes
  first, deeper blocks first on ties (the mock evicts leaves only; a parent is never used later than its
  child, so this order evicts leaves first too).
* **Real capacity.** Each worker has the mock's ``num_blocks``; admission reserves ``ceil((prompt + output)
  / block)`` blocks, reused prompt blocks counted in and pinned, as TensorRT-LLM's GUARANTEED_NO_EVICT and
  the mock do. A worker runs at most ``max_batch`` requests at once (min of the mock's max batch size and
  its per-step token budget: each running request decodes one token per step).
* **Known durations.** A request's service time is computed from the mock's calibrated step costs with the
  known output length, as if it ran alone (no batch slows it down), and it is admitted as soon as a
  worker can hold it. Its prompt blocks count as cached from admission, not from the end of its prefill.
* **Placement.** Greedy, in arrival order: among the workers that can admit the request now, the one whose
  cache gives the most reusable blocks (ties: fewest running requests, then most free blocks, then lowest
  index); if none can, the one that can soonest, by ending its running requests in order of their ends.

What it is: a strong heuristic, NOT a proven upper bound. The eviction and the timing assumptions are
optimistic (shorter lives free reservations early; blocks are shareable before the prefill ends; a worker
that released requests to admit one is never behind the clock for the next), but greedy placement in
arrival order is not optimal (placing a request for the sake of a later one is never considered), and
Belady's rule is optimal for one cache with unit pages, not for several caches with pinned reservations.
So an online router may in principle beat it; if one does, the next place to look is the placement rule.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.prefix_oracle import block_chain

NEVER = math.inf


@dataclass(frozen=True)
class EngineModel:
    """The per-worker capacity and step costs the mock is started with (in simulated ms, per mock token)."""

    workers: int
    num_blocks: int
    block_tokens: int
    max_batch: int
    max_num_tokens: int
    step_base_ms: float
    prefill_ms_per_token: float
    decode_ms_per_token: float
    kv_read_ms_per_token: float

    def reservation(self, prompt_tokens: int, output_tokens: int) -> int:
        """Blocks a request holds while it runs: prompt and output, as the mock reserves on admission."""
        return -(-(prompt_tokens + output_tokens) // self.block_tokens)

    def service_ms(self, prompt_tokens: int, uncached: int, output_tokens: int) -> float:
        """The request's life on an otherwise idle worker: its prefill steps, then one step per further token,
        each reading the context so far (the short end of what the mock would take under load)."""
        steps = max(1, -(-uncached // self.max_num_tokens))
        prefill = steps * self.step_base_ms + uncached * self.prefill_ms_per_token
        rest = max(0, output_tokens - 1)
        context = rest * (prompt_tokens + output_tokens / 2)
        return prefill + rest * (self.step_base_ms + self.decode_ms_per_token) + context * self.kv_read_ms_per_token


@dataclass
class _Alloc:
    held: list[int]  # cached blocks this request pins
    private: int  # blocks reserved beyond them (the output)


@dataclass
class _Worker:
    """One worker's cache as the mock keeps it: cached blocks with pin counts, private blocks, running set."""

    capacity: int
    refs: dict[int, int] = field(default_factory=dict)  # cached block -> requests pinning it
    depth: dict[int, int] = field(default_factory=dict)  # cached block -> position in its chain
    unpinned: set[int] = field(default_factory=set)  # cached blocks no running request holds: evictable
    private: int = 0
    running: list[tuple[float, int, _Alloc]] = field(default_factory=list)  # heap of (end ms, seq, alloc)

    def used(self) -> int:
        return len(self.refs) + self.private

    def reused(self, chain: Sequence[int], reusable: int) -> int:
        k = 0
        while k < reusable and chain[k] in self.refs:
            k += 1
        return k

    def fits(self, chain: Sequence[int], reused: int, need: int, max_batch: int) -> bool:
        """Whether admission would succeed now (the mock's test: new blocks <= free + evictable)."""
        if len(self.running) >= max_batch:
            return False
        pinned_now = sum(1 for h in chain[:reused] if h in self.unpinned)
        return need - reused <= self.capacity - self.used() + len(self.unpinned) - pinned_now

    def pin(self, h: int) -> None:
        self.refs[h] += 1
        self.unpinned.discard(h)

    def unpin(self, h: int) -> None:
        self.refs[h] -= 1
        if self.refs[h] == 0:
            self.unpinned.add(h)

    def release_until(self, t_ms: float) -> None:
        """End every running request whose end is at or before ``t_ms``."""
        while self.running and self.running[0][0] <= t_ms:
            _, _, a = heapq.heappop(self.running)
            for h in a.held:
                self.unpin(h)
            self.private -= a.private

    def copy(self) -> _Worker:
        return _Worker(self.capacity, dict(self.refs), dict(self.depth), set(self.unpinned), self.private,
                       list(self.running))


@dataclass
class _Future:
    """For Belady eviction: which requests (by arrival index) reuse each block."""

    uses: dict[int, list[int]]

    def next_use(self, h: int, after: int) -> float:
        xs = self.uses.get(h)
        if not xs:
            return NEVER
        i = bisect.bisect_right(xs, after)
        return xs[i] if i < len(xs) else NEVER


def _future(chains: Sequence[Sequence[int]], reusable: Sequence[int]) -> _Future:
    uses: dict[int, list[int]] = {}
    for i, (chain, r) in enumerate(zip(chains, reusable, strict=True)):
        for h in chain[:r]:
            uses.setdefault(h, []).append(i)
    return _Future(uses)


def _evict(w: _Worker, k: int, fut: _Future, now: int) -> int:
    """Evict the ``k`` unpinned blocks used farthest in the future (deepest first on ties)."""
    if k <= 0:
        return 0
    victims = heapq.nlargest(k, w.unpinned, key=lambda h: (fut.next_use(h, now), w.depth[h]))
    for h in victims:
        w.unpinned.discard(h)
        del w.refs[h]
        del w.depth[h]
    return len(victims)


def _admit(w: _Worker, i: int, chain: Sequence[int], reused: int, need: int, end_ms: float, fut: _Future) -> int:
    """Reserve, evict, and store the prompt's blocks at once; returns the blocks evicted."""
    for h in chain[:reused]:
        w.pin(h)
    new = need - reused
    evicted = _evict(w, new - (w.capacity - w.used()), fut, i)
    w.private += new
    alloc = _Alloc(held=list(chain[:reused]), private=new)
    for pos in range(reused, len(chain)):
        h = chain[pos]
        w.private -= 1
        alloc.private -= 1
        if h in w.refs:
            w.pin(h)
        else:
            w.refs[h], w.depth[h] = 1, pos
        alloc.held.append(h)
    heapq.heappush(w.running, (end_ms, i, alloc))
    return evicted


def _soonest(w: _Worker, chain: Sequence[int], reusable: int, need: int, max_batch: int) -> tuple[float, int]:
    """When ``w`` could admit the request if its running requests end on time, and the blocks it would reuse."""
    trial = w.copy()
    while trial.running:
        t = trial.running[0][0]
        trial.release_until(t)
        r = trial.reused(chain, reusable)
        if trial.fits(chain, r, need, max_batch):
            return t, r
    return NEVER, 0


def _choose(ws: Sequence[_Worker], chain: Sequence[int], reusable: int, need: int,
            max_batch: int) -> tuple[int, float | None, int]:
    """(worker, admission time if it must wait else None, reused blocks) by the placement rule above."""
    now = []
    for k, w in enumerate(ws):
        r = w.reused(chain, reusable)
        if w.fits(chain, r, need, max_batch):
            now.append((-r, len(w.running), w.used(), k))
    if now:
        best = min(now)
        return best[3], None, -best[0]
    waits = [(*_soonest(w, chain, reusable, need, max_batch), k) for k, w in enumerate(ws)]
    t, r, k = min(waits, key=lambda x: (x[0], -x[1], x[2]))
    if t == NEVER:
        raise ValueError(f"a request of {need} blocks can never fit {ws[0].capacity} blocks per worker")
    return k, t, r


def route(prompts: Sequence[Sequence[int]], outputs: Sequence[int], arrivals_ms: Sequence[float],
          m: EngineModel, chains: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """Place every request, in arrival order, and report the cached-token ratio that placement reaches.

    ``arrivals_ms`` are in simulated engine time (the trace's timestamps over the load multiplier; the mock's
    ``--speedup`` compresses arrivals and service alike, so it does not enter).
    ``chains``: each prompt's block hashes when its blocks are keyed by more than their tokens (image blocks
    keyed by the items over them, bench_multimodal); default: the token-only chain of each prompt.
    """
    bs = m.block_tokens
    if chains is None:
        chains = [block_chain(p, bs) for p in prompts]
    elif len(chains) != len(prompts) or any(len(c) != len(p) // bs for c, p in zip(chains, prompts, strict=True)):
        raise ValueError("one chain per prompt, one hash per full block")
    reusable = [(len(p) - 1) // bs for p in prompts]
    fut = _future(chains, reusable)
    ws = [_Worker(m.num_blocks) for _ in range(m.workers)]
    placed: list[int] = []
    cached = total = evicted = waited = 0
    wait_ms = 0.0
    for i, (p, out, t) in enumerate(zip(prompts, outputs, arrivals_ms, strict=True)):
        for w in ws:
            w.release_until(t)
        need = m.reservation(len(p), out)
        k, t_admit, r = _choose(ws, chains[i], reusable[i], need, m.max_batch)
        start = t
        if t_admit is not None:
            ws[k].release_until(t_admit)
            r = ws[k].reused(chains[i], reusable[i])
            start, waited, wait_ms = t_admit, waited + 1, wait_ms + (t_admit - t)
        end = start + m.service_ms(len(p), len(p) - r * bs, out)
        evicted += _admit(ws[k], i, chains[i], r, need, end, fut)
        placed.append(k)
        cached += r * bs
        total += len(p)
    return {"cached_ratio": cached / total if total else 0.0, "cached_tokens": cached, "prompt_tokens": total,
            "per_worker_requests": [placed.count(k) for k in range(m.workers)], "waited_requests": waited,
            "mean_wait_ms": wait_ms / waited if waited else 0.0, "evicted_blocks": evicted, "placement": placed}
