"""Commit hook: everything a committed decision counts (and only a committed one: a proposal that fails, or
`/debug/score`'s, counts nothing)."""

from __future__ import annotations

import logging
import time

from epp_extproc.core.contract import BookingHandle
from epp_extproc.core.decision import Stopwatch
from epp_extproc.core.proposal import Proposal
from epp_extproc.metrics import PickerMetrics

log = logging.getLogger("epp_extproc.core.director")


class DecisionMetricsHook:
    name = "decision-metrics"

    def __init__(self, metrics: PickerMetrics) -> None:
        self.metrics = metrics

    def committed(self, p: Proposal, booking: BookingHandle) -> Stopwatch | None:
        m = self.metrics
        m.pd_decisions.labels(p.pd.path.value, p.pd.reason.value).inc()
        m.score_seconds.observe(p.score_seconds)
        m.decision_seconds.observe(time.perf_counter() - p.started)
        m.picks.labels(p.address).inc()
        m.requests.labels("routed").inc()
        plan = p.plan
        if plan.salted_load_only:
            m.requests.labels("salted_load_only").inc()
        if p.rewrite is not None:
            rw = p.rewrite
            m.model_rewrites.labels(rw.resource, rw.label_model, rw.target).inc()
        if p.session is not None:
            m.session_affinity.labels(p.session.value).inc()
        if p.passthrough is not None:
            m.prompt_passthrough.labels(p.passthrough.forward, p.passthrough.reason).inc()
        if plan.media is not None:
            scored, why = plan.media_outcome()
            m.media_requests.labels(scored.value, why).inc()
            for part in plan.media.parts:
                m.media_items.labels(part.modality, part.source.value).inc()
        if log.isEnabledFor(logging.DEBUG):
            r = p.primary
            log.debug("-> %s via %s (cost %.2f, overlap %d blocks)", p.address, plan.route, r.table.cost[r.chosen],
                      r.table.overlap[r.chosen])
        return None
