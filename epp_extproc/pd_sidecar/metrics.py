"""The sidecar's Prometheus metrics: one registry per sidecar (tests run several in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class SidecarMetrics:
    """Requests by route, legs by outcome and duration, retries and fallbacks of the prefill leg, and the
    allowlist's size and watch health (an SSRF allowlist that silently stops following the pool is the failure
    an operator must be able to see)."""

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
        self.allowed = Gauge("pd_sidecar_allowed_prefillers", "ip:port entries the sidecar may call, by source: "
                             "static (--allowed-prefillers) or pool (--inference-pool)", ["source"], registry=r)
        self.allowlist_updates = Counter("pd_sidecar_allowlist_updates", "Allowlist rebuilds from the pool "
                                         "watch", registry=r)
        self.allowlist_over_cap = Gauge("pd_sidecar_allowlist_over_cap", "Pool entries left out of the "
                                        "allowlist by --max-allowed-prefillers (refused until the pool shrinks)",
                                        registry=r)
        self.allowlist_watch_errors = Counter("pd_sidecar_allowlist_watch_errors", "Failed list/watch calls of "
                                              "the InferencePool or its pods (the last known list stays)",
                                              ["resource"], registry=r)
        self.allowlist_synced = Gauge("pd_sidecar_allowlist_synced", "1 once the pool and its pods have been "
                                      "listed (always 1 without --inference-pool)", registry=r)
