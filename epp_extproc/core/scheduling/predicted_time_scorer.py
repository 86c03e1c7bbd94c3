"""`predicted-time-scorer` (`--cost-model time`): each row's predicted TTFT and TPOT from its worker's learned
model (core/time_cost.py), and a cost in seconds; with llm-d's SLO headers only the rows predicted to meet
them may be picked. When none can, a sheddable request (its objective's priority < 0) is refused (429) and
any other is routed best effort; the outcome (`met`, `best_effort`) is counted at commit.

The stopwatch of the chosen worker starts at commit (`observe`): its first chunk and its end teach that
worker's model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from epp_extproc.core.decision import Stopwatch
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest, plain
from epp_extproc.core.time_cost import TimeCost, meets

if TYPE_CHECKING:
    from epp_extproc.core.scheduling.deps import SchedulingDeps

NOTE = "predicted-time-scorer"


class PredictedTimeScorer:
    name = NOTE

    def __init__(self, model: TimeCost, block_size: Callable[[str], float], *, overlap_credit: float = 1.0,
                 prefill_load_scale: float = 1.0) -> None:
        self.model = model
        self._block_size = block_size
        self.overlap_credit = overlap_credit
        self.prefill_load_scale = prefill_load_scale

    def prepare(self, req: SchedulingRequest, table: CandidateTable) -> None:
        return None

    def score(self, req: SchedulingRequest, table: CandidateTable) -> list[float]:
        features, predict, bs = self.model.features, self.model.predict, self._block_size
        credit, scale = self.overlap_credit, self.prefill_load_scale
        rows: list[tuple[float, float]] = []
        cost: list[float] = []
        pbs, ovs = plain(table.prompt_blocks, table.overlap)
        for a, load, pb, ov in zip(table.addresses, table.loads, pbs, ovs, strict=True):
            ttft, tpot, c = predict(a, features(load, pb, ov, bs(a), credit, scale))
            rows.append((ttft, tpot))
            cost.append(c)
        table.notes[NOTE] = rows
        return cost

    def admissible(self, req: SchedulingRequest, table: CandidateTable,
                   outcome: dict[str, Any]) -> list[int] | None:
        slo = req.ctx.slo
        if slo is None:
            return None
        rows = table.notes[NOTE]
        met = [i for i, (ttft, tpot) in enumerate(rows) if meets(ttft, tpot, slo)]
        if met:
            outcome["slo"] = "met"
            return met
        if req.sheddable is not None and req.sheddable(req.ctx):
            raise PickError(Problem.SLO_UNMET, "no worker is predicted to meet the request's SLO")
        outcome["slo"] = "best_effort"
        return None

    def observe(self, table: CandidateTable, i: int, booking_id: str) -> Stopwatch:
        """Commit hook: the chosen row's stopwatch, stopped by its booking's first-chunk signal."""
        a = table.addresses[i]
        pb, ov = plain(table.prompt_blocks, table.overlap)  # Python numbers, as the list path's
        f = self.model.features(table.loads[i], pb[i], ov[i], self._block_size(a),
                                self.overlap_credit, self.prefill_load_scale)
        return self.model.observe(a, f, table.notes[NOTE][i][0], booking_id)

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> PredictedTimeScorer:
        return cls(deps.time_model(), deps.block_size, overlap_credit=float(params.get("overlapCredit", 1.0)),
                   prefill_load_scale=float(params.get("prefillLoadScale", 8.0)))
