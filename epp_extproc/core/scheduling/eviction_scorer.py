"""Eviction-aware choice (`eviction-scorer` (`--eviction-aware`)): credit only the overlap that will still be there, and do not
flush a worker's cache with a long new prefix when another worker has room.

Why: the block cost credits a worker's cached prefix as if it were certain to be reused. Under cache
pressure it is not: between the pick and the request's admission, the worker allocates the blocks of every
request booked ahead of it plus this request's own uncached blocks, and an engine that is out of free blocks
evicts its least recently used reusable ones to find them (vLLM's free-block queue, TensorRT-LLM's reuse
tree, the mock's LRU). Sending a prefix there buys a recompute; sending a new long prefix there flushes other
prefixes that later requests were routed for.

The figures, per candidate worker, all from what the picker really has (docs/eviction-aware.md):
  C  capacity: the most blocks the worker's KV events ever showed it holding, once it has removed blocks
     (kvindex/churn.py); unknown (None) = not known to be full, and then nothing here changes its cost;
  H  blocks it holds now (its events);
  P  blocks its running requests pin: the engine's KV usage gauge x C when a fresh scrape has it
     (`trtllm_kv_cache_utilization`, `vllm:kv_cache_usage_perc`: both count reusable idle blocks as free),
     else this picker's decode bookings on it;
  N  blocks it must allocate before this request is admitted: booked prefill blocks (requests booked there
     and not yet past their first token) + this request's own uncached blocks;
  F  free room = C - max(H, P) (blocks neither indexed nor pinned); L = blocks an allocation may take,
     free or reusable = max(C - P, 1) (C = free + reusable + pinned; the split of the pinned blocks between
     indexed prompt blocks and private output reservations is not published, so L is not taken from H).
Rule (a): E = max(N - F, 0) blocks will be evicted; a credited block survives with probability
     s = max(0, 1 - E / L) (LRU order of the prefix is unknown to the picker: every reusable block is taken
     as equally at risk), so the overlap credited is overlap x s; the rest is `overlap_discount`.
Rule (b): this request's own new blocks beyond the free room flush other prefixes:
     flush = min(own uncached blocks, E); the penalty is `FLUSH_PENALTY` x (flush - the smallest flush among
     the candidates), so it only moves a request when another worker has more room.
The removal rate (blocks/s over the window) and the LRU lifetime it implies (L / rate) are shown in
`/debug/score`; they are explanations: the count rule above already says what LRU does with N allocations.

Cost: O(candidates) per decision, a few float operations each; nothing per block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from epp_extproc.core.scheduling.profile import NoScore
from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest

if TYPE_CHECKING:
    from epp_extproc.core.scheduling.deps import SchedulingDeps

FLUSH_PENALTY = 1.0  # cost of one flushed block of someone else's prefix, in blocks to prefill


class ChurnView(Protocol):
    """What the rule reads of the worker's KV events (kvindex.churn.ChurnWindow is one)."""

    def capacity(self, worker: str) -> int | None: ...

    def held(self, worker: str) -> int: ...

    def removal_rate(self, worker: str) -> float: ...


@dataclass(frozen=True, slots=True)
class Pressure:
    """One worker's cache figures at a decision (see the module docstring for the letters)."""

    capacity: int | None
    held: int
    pinned: float
    pinned_source: str  # "usage_gauge" | "bookings"
    removal_rate: float

    @property
    def free(self) -> float:
        return 0.0 if self.capacity is None else max(self.capacity - max(self.held, self.pinned), 0.0)

    @property
    def reusable(self) -> float:
        """Blocks an allocation may take (free or reusable): every block no running request pins."""
        return max((self.capacity or 0) - self.pinned, 1.0)


@dataclass(frozen=True, slots=True)
class EvictionFigures:
    """What the rule computed for one candidate (`/debug/score` shows it)."""

    pressure: Pressure
    allocate: float  # N
    evict: float  # E
    survival: float  # s
    flush: float
    discount: float  # overlap blocks likely evicted: overlap x (1 - s)
    penalty: float = 0.0

    def explain(self) -> dict[str, Any]:
        p = self.pressure
        return {"capacity_blocks": p.capacity, "held_blocks": p.held, "pinned_blocks": round(p.pinned, 3),
                "pinned_from": p.pinned_source, "free_blocks": round(p.free, 3),
                "removal_rate_blocks_s": round(p.removal_rate, 3),
                "lru_lifetime_s": round(p.reusable / p.removal_rate, 3) if p.removal_rate > 0 else None,
                "allocate_before_admission": round(self.allocate, 3), "would_evict": round(self.evict, 3),
                "survival": round(self.survival, 4), "overlap_discount": round(self.discount, 3),
                "would_flush": round(self.flush, 3), "flush_penalty": round(self.penalty, 3)}


class EvictionScorer(NoScore):
    """Rule (a) in `prepare` (it lowers every row's `credited` overlap, which every pricing plugin reads) and
    rule (b) in `score` (the flush penalty, in blocks: it adds to the block cost)."""

    name = "eviction-scorer"
    note = "eviction"  # its per-row figures, under this key in the table's notes and each `/debug/score` row

    def __init__(self, churn: ChurnView, usage: Callable[[str], float | None]) -> None:
        self._churn = churn
        self._usage = usage  # the worker's fresh KV usage gauge (fraction of blocks in use), None if unknown

    def pressure(self, address: str, decode_blocks: float) -> Pressure:
        cap = self._churn.capacity(address)
        u = self._usage(address)
        if cap is not None and u is not None:
            pinned, source = u * cap, "usage_gauge"
        else:
            pinned, source = decode_blocks, "bookings"
        return Pressure(cap, self._churn.held(address), pinned, source, self._churn.removal_rate(address))

    def prepare(self, req: SchedulingRequest, table: CandidateTable) -> None:
        if req.prompt is None:  # routed by load: no overlap to discount, no prompt blocks to flush
            return
        figures: list[EvictionFigures] = []
        credited = table.credited
        for i, (a, load, pb, ov) in enumerate(zip(table.addresses, table.loads, table.prompt_blocks, table.overlap,
                                                 strict=True)):
            p = self.pressure(a, load.decode_blocks)
            own = max(pb - ov, 0.0)
            n = load.prefill_blocks + own
            if p.capacity is None:
                e, s = 0.0, 1.0
            else:
                e = max(n - p.free, 0.0)
                s = max(0.0, 1.0 - e / p.reusable)
            discount = ov * (1.0 - s)
            credited[i] = ov - discount
            figures.append(EvictionFigures(p, n, e, s, min(own + discount, e), discount))
        table.notes[self.note] = figures

    def score(self, req: SchedulingRequest, table: CandidateTable) -> list[float]:
        figures: list[EvictionFigures] | None = table.notes.get(self.note)
        if figures is None:
            return [0.0] * len(table)
        least = min((f.flush for f in figures), default=0.0)
        penalties = [FLUSH_PENALTY * (f.flush - least) for f in figures]
        table.notes[self.note] = [EvictionFigures(f.pressure, f.allocate, f.evict, f.survival, f.flush, f.discount, pen)
                                  for f, pen in zip(figures, penalties, strict=True)]
        return penalties

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> EvictionScorer:
        if deps.churn is None or deps.usage is None:
            raise ValueError("eviction-scorer reads the in-process KV index's removals: it needs "
                             "--kv-ingest inprocess and a KV-aware picker (--tokenizer-protocol)")
        return cls(deps.churn, deps.usage)
