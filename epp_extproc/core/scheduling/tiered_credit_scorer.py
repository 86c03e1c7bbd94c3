"""`tiered-credit` (issue 44): a worker's cached prefix is credited block by block at the best tier holding
each block, so blocks offloaded to host memory, disk or shared storage are worth routing to.

Why: loading a block from host memory is much cheaper than recomputing it, so a worker holding the prefix off
the GPU is a far better choice than one holding nothing; GPU-only credit (`overlap`) sees none of it. The
index keeps every tier a block sits on (kvindex/tiers.py, `KvIndex.overlap_tiers`); this preparer turns each
candidate's leading blocks at any tier into

    credited += sum over leading positions of max(weight of a tier holding it) - overlap

i.e. the GPU part keeps its credit and what continues on a lower tier adds its weight. One position is one
block whatever number of tiers or offload-chunk announcements hold it: llm-d overcounted CPU hits when a large
offload block was split into smaller keys (llm-d issue #2889); a position here is counted once.

Default weights, per tier (flags `--router-host-cache-hit-weight`, `--router-disk-cache-hit-weight`, Dynamo's
names, and this plugin's parameters):
  gpu 1.0      the block is reused as it is;
  host 0.8     llm-d's cpu default (its scorer's medium weights: gpu 1.0, cpu_pinned 0.8); Dynamo's host
               default is 0.75. The load-time model of issue 44 agrees: 64 KiB/token for Llama-3.1-8B FP8, 2 MiB
               per 32-token block over 25 GB/s = 84 us, against 0.45 ms to prefill 32 tokens at the mock's
               fitted ~70k tokens/s (trtllm_mock/config.py LOAD_VS_PREFILL: a load costs 0.185 of a prefill),
               so a host block saves 0.815 of what a GPU one does; a GPU copy always wins a tie. A weight
               of 0.97 was not distinguishable from 0.8 on the trace or multi-turn (bench/README.md, stop 53);
  disk 0.25    Dynamo's disk default (5 GB/s = 420 us per block, plus NVMe queueing and page-cache misses);
  shared 0.25  a store other workers mount loads at most at storage speed over a network: priced as disk;
  unknown 0.25 a medium no engine is known to send is at least off the GPU; llm-d credits unknown tiers 1.0,
               which would let a mislabeled slow tier beat a GPU copy, so the lowest known off-GPU weight.

Placement: after any plugin that rewrites `credited` outright (the eviction scorer sets credited = overlap x
survival), since this one adds to the column; config_file.spec_from_config appends it last. While the index
holds nothing off the GPU the preparer returns at once (no notes, no change): a GPU-only pool decides exactly
as without it. Both KV views answer tiered lookups: the in-process index (`KvRouting.tiers`) and, under
`--kv-ingest apart`, the ingest shards (`RemoteKv.tiers`, one more round trip per decision while a shard holds
a block off the GPU, none otherwise).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from epp_extproc.core.scheduling.profile import NoScore
from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest
from kvindex.tiers import TIER_BIT, TIERS

if TYPE_CHECKING:
    from epp_extproc.core.contract import BookingHandle, PromptKey
    from epp_extproc.core.proposal import Proposal
    from epp_extproc.core.scheduling.deps import SchedulingDeps

NAME = "tiered-credit"
DEFAULT_WEIGHTS: Mapping[str, float] = {"gpu": 1.0, "cpu": 0.8, "disk": 0.25, "shared": 0.25, "unknown": 0.25}
# the plugin's parameter per tier (config_file.py's type table names the same)
PARAMS: Mapping[str, str] = {"gpu": "gpuWeight", "cpu": "hostWeight", "disk": "diskWeight",
                             "shared": "sharedWeight", "unknown": "unknownWeight"}


class TierView(Protocol):
    """What the preparer asks of the KV side (adapters/kv_routing.KvRouting is one)."""

    def has_tiers(self) -> bool: ...

    def tiers(self, prompt: PromptKey, workers: Sequence[str]) -> Mapping[str, Sequence[tuple[int, int]]]: ...


@dataclass(frozen=True, slots=True)
class TierCredit:
    """One candidate's tiered credit: blocks per tier (each position at its best tier) and the sum."""

    blocks: Mapping[str, int]
    credit: float
    added: float  # what this plugin added to `credited` (credit - overlap)

    def explain(self) -> dict[str, Any]:
        return {"blocks_by_tier": dict(self.blocks), "credit_blocks": round(self.credit, 3),
                "added_to_credited": round(self.added, 3)}


_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()


def _counter(registry: CollectorRegistry) -> Counter:
    """One counter per picker registry (the plugin is built once per profile)."""
    c = _COUNTERS.get(registry)
    if c is None:
        c = _COUNTERS[registry] = Counter(
            "epp_tiered_credit_blocks", "Leading blocks of committed decisions' chosen workers, by the best tier "
            "holding each (tiered-credit)", ["tier"], registry=registry)
    return c


class TieredCreditScorer(NoScore):
    """Adjusts `credited` in `prepare`; scores nothing itself (the block cost prices the column)."""

    name = NAME
    note = "tiered_credit"  # its per-row credit, under this key in the table's notes and each `/debug/score` row

    def __init__(self, view: TierView, weights: Mapping[str, float], counter: Counter | None = None) -> None:
        self._view = view
        self.weights = {t: float(weights.get(t, DEFAULT_WEIGHTS[t])) for t in TIERS}
        self._counter = counter
        # per position code (OR of TIER_BIT), the tier credited: the heaviest tier holding it, ties to the
        # faster one (TIERS order); 32 codes, computed once
        self._best: list[str] = [
            max((t for t in TIERS if code & TIER_BIT[t]), key=lambda t: (self.weights[t], -TIERS.index(t)))
            if code else TIERS[0] for code in range(1 << len(TIERS))]

    def credit(self, runs: Sequence[tuple[int, int]]) -> tuple[dict[str, int], float]:
        """Blocks per tier (each position at its best tier) and their weighted sum."""
        blocks: dict[str, int] = {}
        total = 0.0
        best, w = self._best, self.weights
        for code, n in runs:
            t = best[code]
            blocks[t] = blocks.get(t, 0) + n
            total += w[t] * n
        return blocks, total

    def prepare(self, req: SchedulingRequest, table: CandidateTable) -> None:
        if req.prompt is None or not self._view.has_tiers():
            return
        tiers = self._view.tiers(req.prompt, table.addresses)
        credited, overlap = table.credited, table.overlap
        notes: list[TierCredit | None] = []
        for i, a in enumerate(table.addresses):
            runs = tiers.get(a)
            if not runs:
                notes.append(None)
                continue
            blocks, total = self.credit(runs)
            added = total - overlap[i]
            credited[i] += added
            notes.append(TierCredit(blocks, total, added))
        table.notes[self.note] = notes

    def score(self, req: SchedulingRequest, table: CandidateTable) -> list[float]:
        return [0.0] * len(table)

    def committed(self, p: Proposal, booking: BookingHandle) -> None:
        """Commit hook (build.py adds a scorer that has one): count the chosen worker's blocks per tier."""
        r = p.primary
        notes = r.table.notes.get(self.note)
        if notes is None or self._counter is None:
            return None
        note = notes[r.chosen]
        if note is not None:
            for tier, n in note.blocks.items():
                self._counter.labels(tier).inc(n)
        return None

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> TieredCreditScorer:
        kv = deps.kv
        if kv is None or not hasattr(kv, "tiers") or not hasattr(kv, "has_tiers"):
            raise ValueError("tiered-credit reads the KV index's tiers: it needs a KV-aware picker "
                             "(--tokenizer-protocol)")
        weights = {t: float(params.get(p, DEFAULT_WEIGHTS[t])) for t, p in PARAMS.items()}
        for t, v in weights.items():
            if not v >= 0.0:
                raise ValueError(f"{PARAMS[t]} must be >= 0, not {v!r}")
        return cls(kv, weights, _counter(deps.metrics.registry))  # type: ignore[arg-type]
