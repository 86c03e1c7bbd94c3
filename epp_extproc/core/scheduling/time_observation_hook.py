"""Commit hook of the predicted-time scorer: the chosen worker's stopwatch starts (its first chunk and its
end teach the worker's model), and a request with a latency objective is counted by its outcome."""

from __future__ import annotations

from epp_extproc.core.contract import BookingHandle
from epp_extproc.core.decision import Stopwatch
from epp_extproc.core.proposal import Proposal
from epp_extproc.core.scheduling.predicted_time_scorer import PredictedTimeScorer
from epp_extproc.metrics import PickerMetrics


class TimeObservationHook:
    name = "time-observation"

    def __init__(self, scorer: PredictedTimeScorer, metrics: PickerMetrics) -> None:
        self.scorer = scorer
        self.metrics = metrics

    def committed(self, p: Proposal, booking: BookingHandle) -> Stopwatch | None:
        if p.slo is not None:
            self.metrics.slo_decisions.labels(p.slo).inc()
        r = p.primary
        if r.table.notes.get(self.scorer.name) is None:  # the destination was not priced in time
            return None
        return self.scorer.observe(r.table, r.chosen, booking.id)
