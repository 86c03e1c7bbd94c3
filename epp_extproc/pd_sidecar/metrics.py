"""The sidecar's Prometheus metrics: one registry per sidecar (tests run several in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class SidecarMetrics:
    """Requests by route, legs by outcome and duration, retries and fallbacks of the prefill leg."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pd_sidecar_requests", "Requests by how they were served: local (no prefill "
                                "worker named, or kept local), disaggregated, fallback (prefill leg failed, "
                                "prefilled locally), refused", ["route", "reason"], registry=r)
        self.legs = Counter("pd_sidecar_legs", "Legs by outcome", ["leg", "outcome"], registry=r)
        self.leg_seconds = Histogram("pd_sidecar_leg_seconds", "Leg duration (decode: until its last byte)",
                                     ["leg"], buckets=LEG_BUCKETS, registry=r)
        self.prefill_retries = Counter("pd_sidecar_prefill_retries", "Prefill legs retried (502/503/504 or "
                                       "unreachable)", registry=r)
        self.fallbacks = Counter("pd_sidecar_prefill_fallbacks", "Requests prefilled locally after the prefill "
                                 "leg failed", ["reason"], registry=r)
