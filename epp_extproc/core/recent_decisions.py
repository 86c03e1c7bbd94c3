"""The last decisions, for the debug page: a bounded ring fed by a commit hook, and only while someone looks.

The page (epp_extproc/debug_page.py) asks `GET /debug/decisions` every second or two; each read arms the ring
for `WATCH_S`. While disarmed (nobody has the page open), the hook costs one attribute test per request and
keeps nothing. While armed it keeps one small record per committed decision, holding references only (the
scheduling result the decision already made: its candidate table, chosen row and the plugins' notes), in a
deque of `RING_SIZE`: O(1), and the oldest record goes when a new one comes. Turning a record into JSON (names,
the best candidates, credited blocks per tier, the reason in words) happens when the page reads it, never on
the request's path. `/debug/score` proposals are never committed, so they never appear here.

A record is what the decision saw: the table's own columns (overlap, credited blocks, cost) are written once
by the scorers and never after. Load figures are not shown per candidate here, because the load tracker
updates its entries in place (they would read as now, not as then); the pool table shows the live load.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from epp_extproc.core.contract import BookingHandle
from epp_extproc.core.decision import Stopwatch
from epp_extproc.core.proposal import Proposal
from epp_extproc.core.scheduling.result import PdPath, PdReason, SchedulingResult
from epp_extproc.core.scheduling.table import CandidateTable

RING_SIZE = 50  # decisions kept: what a page shows, and the most the page keeps itself
WATCH_S = 60.0  # a read keeps the ring recording this long; then the hook is free again
TOP_CANDIDATES = 8  # candidates shown per decision (the cheapest; the chosen one always)
MODEL_CHARS = 128  # a model name is clipped to this (it comes from the client's body)
TIER_NOTE = "tiered_credit"  # the tiered-credit scorer's per-row note (blocks credited per tier)


@dataclass(slots=True)
class DecisionRecord:
    """One committed decision, by reference: no copy of the table, the prompt or the body."""

    seq: int
    at: float  # wall-clock seconds (the page shows the time of day)
    model: str | None
    result: SchedulingResult
    route: str  # "kv": the prompt was scored against the index; "load": routed by load only
    load_reason: str | None  # why routed by load only (core/plan.Plan.load_reason)
    prompt_tokens: int
    booked_blocks: float
    predicted_cached_tokens: int | None


class RecentDecisions:
    """A commit hook (core/director.CommitHook) that keeps the last `size` decisions while it is watched."""

    name = "recent-decisions"

    def __init__(self, size: int = RING_SIZE, watch_s: float = WATCH_S,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.size = size
        self.watch_s = watch_s
        self._clock = clock
        self._wall = wall
        self._ring: deque[DecisionRecord] = deque(maxlen=size)
        self._seq = itertools.count(1)
        self.last_seq = 0
        self._until = 0.0  # 0: disarmed (the hook returns at once); else recording until this monotonic time

    @property
    def armed(self) -> bool:
        return self._until != 0.0 and self._clock() < self._until

    def watch(self) -> None:
        """Someone reads the ring: record the decisions of the next `watch_s` seconds."""
        self._until = self._clock() + self.watch_s

    def __len__(self) -> int:
        return len(self._ring)

    def committed(self, p: Proposal, booking: BookingHandle) -> Stopwatch | None:
        """Commit hook: one record when armed, nothing when not (one attribute test)."""
        if self._until == 0.0:
            return None
        if self._clock() >= self._until:  # nobody read it for `watch_s`: stop recording, drop what it held
            self._until = 0.0
            self._ring.clear()
            return None
        seq = self.last_seq = next(self._seq)
        self._ring.append(DecisionRecord(seq, self._wall(), p.model, p.result, p.plan.route, p.request.load_reason,
                                         p.request.prompt_tokens, p.booked_blocks, p.predicted_cached_tokens))
        return None

    def records(self, since: int = 0) -> list[DecisionRecord]:
        """The records newer than `since`, newest first."""
        return [r for r in reversed(self._ring) if r.seq > since]

    def document(self, names: Callable[[str], str | None], since: int = 0) -> dict[str, Any]:
        """`GET /debug/decisions`: arms the ring and answers what it holds, newest first."""
        self.watch()
        return {"size": self.size, "watch_s": self.watch_s, "last_seq": self.last_seq,
                "decisions": [explain(r, names) for r in self.records(since)]}


def _f(x: Any, nd: int = 3) -> float:
    return round(float(x), nd)


def _cheapest_first(cost: Any, chosen: int) -> list[int]:
    """The rows of the `TOP_CANDIDATES` lowest costs, cheapest first, the chosen row always among them."""
    if isinstance(cost, np.ndarray):
        order = np.argsort(cost, kind="stable")[:TOP_CANDIDATES].tolist()
    else:
        order = sorted(range(len(cost)), key=cost.__getitem__)[:TOP_CANDIDATES]
    if chosen not in order:
        order[-1] = chosen
    return order


def _rows(table: CandidateTable, chosen: int, names: Callable[[str], str | None]) -> list[dict[str, Any]]:
    """The cheapest candidates and the chosen one, with what the decision credited each."""
    tiers = table.notes.get(TIER_NOTE)
    out = []
    for i in _cheapest_first(table.cost, chosen):
        a = table.addresses[i]
        row: dict[str, Any] = {"name": names(a), "address": a, "chosen": i == chosen,
                               "overlap_blocks": int(table.overlap[i]), "credited_blocks": _f(table.credited[i]),
                               "prompt_blocks": _f(table.prompt_blocks[i]), "cost": _f(table.cost[i], 4)}
        note = tiers[i] if tiers is not None else None
        if note is not None:
            row["blocks_by_tier"] = note.explain().get("blocks_by_tier")
        out.append(row)
    return out


def reason(r: DecisionRecord) -> str:
    """Why this worker, in words: the route (and why load only), the pick's cost against the cheapest, credited
    blocks, and what a plugin decided besides the cost (session affinity, a latency objective, P/D)."""
    primary = r.result.primary
    t, i = primary.table, primary.chosen
    cheapest = float(np.min(t.cost)) if len(t.cost) else 0.0
    parts = []
    if r.route == "kv":
        parts.append(f"kv: {_f(t.credited[i], 1)} of {_f(t.prompt_blocks[i], 1)} prompt blocks credited on the pick")
    else:
        parts.append(f"load only ({r.load_reason or 'prompt not scored'})")
    c = float(t.cost[i])
    parts.append("lowest cost" if c <= cheapest else f"cost {c:.4g}, lowest {cheapest:.4g}")
    session = primary.outcome.get("session")
    if session is not None:
        parts.append(f"session affinity: {getattr(session, 'value', session)}")
    slo = primary.outcome.get("slo")
    if slo is not None:
        parts.append(f"latency objective: {slo}")
    pd = r.result.pd
    if pd.path is not PdPath.AGGREGATED or pd.reason is not PdReason.NO_PREFILL_WORKERS:
        parts.append(f"P/D {pd.path.value} ({pd.reason.value})")
    return "; ".join(parts)


def explain(r: DecisionRecord, names: Callable[[str], str | None]) -> dict[str, Any]:
    """A record as the page reads it (JSON-able)."""
    primary = r.result.primary
    pd = r.result.pd
    model = r.model if r.model is None or len(r.model) <= MODEL_CHARS else r.model[:MODEL_CHARS] + "..."
    return {"seq": r.seq, "at": round(r.at, 3), "model": model, "route": r.route, "load_reason": r.load_reason,
            "pick": primary.address, "pick_name": names(primary.address),
            "prefill": pd.address, "prefill_name": names(pd.address) if pd.address else None,
            "pd_path": pd.path.value, "pd_reason": pd.reason.value,
            "prompt_tokens": r.prompt_tokens, "booked_blocks": _f(r.booked_blocks),
            "predicted_cached_tokens": r.predicted_cached_tokens,
            "candidates_total": len(primary.table.addresses),
            "candidates": _rows(primary.table, primary.chosen, names), "reason": reason(r)}
