"""Prometheus metrics of one picker instance.

Each picker gets its own CollectorRegistry so several pickers (tests, two replicas in one process) never
share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp_extproc.core.flow_queue import FlowMetrics

DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25,
                    0.5, 1.0, 2.5, 5.0)
WAIT_BUCKETS = (1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class PickerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("epp_requests", "Requests seen by the picker, by outcome", ["outcome"],
                                registry=r)
        self.decision_seconds = Histogram(
            "epp_decision_seconds", "Time from the end of the request body to the routing decision "
            "(includes the render call when there is one)", buckets=DECISION_BUCKETS, registry=r)
        self.score_seconds = Histogram(
            "epp_score_seconds", "Time spent scoring and picking (index lookup + cost), without render",
            buckets=DECISION_BUCKETS, registry=r)
        self.endpoint_inflight = Gauge("epp_endpoint_inflight_requests",
                                       "Requests booked on each endpoint", ["endpoint"], registry=r)
        self.picker_inflight = Gauge("epp_inflight_requests", "Whole requests inside the picker (from their "
                                     "complete body to the end of the response; --max-inflight-requests)",
                                     registry=r)
        self.incomplete_requests = Gauge("epp_incomplete_requests", "Requests whose headers or body are still "
                                         "arriving (--max-incomplete-requests)", registry=r)
        self.buffered_bytes = Gauge("epp_buffered_body_bytes", "Request-body bytes the picker is buffering "
                                    "right now, across all streams (bounded by --max-buffered-body-bytes)",
                                    registry=r)
        self.endpoints = Gauge("epp_endpoints", "Endpoints currently known", registry=r)
        self.endpoint_roles = Gauge("epp_endpoints_by_role", "Endpoints currently known, by role (prefill, "
                                    "decode, both)", ["role"], registry=r)
        self.pd_decisions = Counter("epp_pd_decisions", "Routing decisions by where the prompt is prefilled "
                                    "(aggregated: a pool without prefill workers; disaggregated; local_prefill) "
                                    "and the decider's reason", ["path", "reason"], registry=r)
        self.picks = Counter("epp_picks", "Routing decisions per endpoint", ["endpoint"], registry=r)
        self.render_requests = Counter("epp_render_requests", "Render (tokenize) calls",
                                       ["protocol", "outcome"], registry=r)
        self.render_seconds = Histogram("epp_render_seconds", "Duration of render calls",
                                        buckets=DECISION_BUCKETS, registry=r)
        self.cached_tokens = Histogram("dynamo_epp_cached_tokens", "Prompt tokens the worker reported as "
                                       "reused from its KV cache (usage.prompt_tokens_details.cached_tokens)",
                                       ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.predicted_cached_tokens = Histogram(
            "epp_predicted_cached_tokens", "Prompt tokens the picker expected the chosen worker to reuse",
            ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.cache_prediction_error = Histogram(
            "epp_cached_tokens_prediction_error", "observed minus predicted cached tokens per request",
            buckets=(-65536, -8192, -1024, -128, -32, -1, 0, 1, 32, 128, 1024, 8192, 65536), registry=r)
        # --cost-model time (core/time_cost.py)
        self.slo_decisions = Counter(
            "epp_slo_decisions", "Requests with x-slo-ttft-ms / x-slo-tpot-ms under --cost-model time, by outcome: "
            "met (a worker predicted to meet it was picked), best_effort (none was, the request is not sheddable), "
            "rejected (none was, the request is sheddable: 429)", ["outcome"], registry=r)
        self.slo_headers_malformed = Counter(
            "epp_slo_headers_malformed", "SLO headers whose value is not a number (ignored, as llm-d does)",
            ["header"], registry=r)
        self.ttft_prediction_error = Histogram(
            "epp_ttft_prediction_error_ms", "--cost-model time: observed minus predicted time to first token per "
            "worker (ms; the picker's stopwatch from the decision to the first response chunk)", ["endpoint"],
            buckets=(-5000, -1000, -300, -100, -30, -10, 0, 10, 30, 100, 300, 1000, 5000), registry=r)
        self.prompt_tokens = Counter("epp_prompt_tokens", "Prompt tokens reported by workers", ["model"],
                                     registry=r)
        self.lean_signals = Counter("epp_lean_signals", "Lean response mode: first-chunk signals and access-log "
                                    "entries received, and how they matched a request", ["signal"], registry=r)
        self.response_flags = Counter("epp_response_flags", "Envoy response flags of finished requests "
                                      "(lean mode's access log), e.g. downstream_connection_termination",
                                      ["flag"], registry=r)
        self.prompt_passthrough = Counter(
            "epp_prompt_passthrough", "Inference requests by what the forwarded body carried: `tokens` (the "
            "rendered prompt, the worker skips rendering) or `original`, and why", ["forwarded", "reason"],
            registry=r)
        self.media_requests = Counter(
            "epp_media_requests", "Chat requests with media content parts, by how they were scored (`exact`: "
            "image blocks credited with the render's spans; `text_prefix`: only the text before the first "
            "item; `load_only`) and why (a closed set, docs/multimodal.md)", ["scored", "reason"], registry=r)
        self.media_items = Counter(
            "epp_media_items", "Media items of routed requests, by modality (image, video, audio, embeds) and "
            "the identity they were forwarded with (trusted_uuid, salted_uuid, digest, engine, dropped_uuid)",
            ["modality", "identity"], registry=r)
        self.session_affinity = Counter(
            "epp_session_affinity", "Requests that opted in to session affinity (x-session-token), by what their "
            "token came to: honoured, new, unavailable (re-picked), expired, tampered, oversized", ["outcome"],
            registry=r)
        self.fingerprint_reads = Counter(
            "epp_render_fingerprint_reads", "Reads of a worker's /server_info render_fingerprint by outcome "
            "(ok, missing, error)", ["outcome"], registry=r)
        self.model_rewrites = Counter(
            "epp_model_rewrites", "Requests an InferenceModelRewrite rule applied to, by the rule's resource, the "
            "model it matched (`*` for a rule matching every model) and the target chosen; only configured "
            "names, so the labels stay bounded", ["rewrite", "model", "target"], registry=r)
        self.usage_observed = Counter("epp_usage_observed", "Responses whose usage the picker could read",
                                      ["kind"], registry=r)
        # flow control (labels: `priority` = the request's band, bounded by the configured objectives)
        self.flow_queue_size = Gauge("epp_flow_control_queue_size", "Requests waiting in the flow-control "
                                     "queue, per priority band", ["priority"], registry=r)
        self.flow_wait_seconds = Histogram(
            "epp_flow_control_queue_wait_seconds", "Time requests spent in the flow-control queue, by how it "
            "ended (dispatched, or the drop reason)", ["priority", "outcome"], buckets=WAIT_BUCKETS, registry=r)
        self.flow_dispatched = Counter("epp_flow_control_dispatched", "Requests let through by flow control",
                                       ["priority"], registry=r)
        self.flow_rejected = Counter("epp_flow_control_rejected", "Requests flow control answered itself, "
                                     "by reason (rejected-saturated, rejected-ttl-expired, rejected-no-endpoints, "
                                     "rejected-shutting-down, client_cancelled)", ["priority", "reason"], registry=r)
        self.flow_saturated = Gauge("epp_flow_control_pool_saturated", "1 while requests are held because every "
                                    "eligible worker is saturated", registry=r)
        self.worker_scrape_errors = Counter("epp_worker_metrics_scrape_errors", "Failed scrapes of a worker's "
                                            "engine metrics", ["endpoint"], registry=r)


class PromFlowMetrics(FlowMetrics):
    """Feeds the flow controller's events into the picker's Prometheus metrics."""

    def __init__(self, m: PickerMetrics) -> None:
        self.m = m

    def queued(self, priority: int, size: int) -> None:
        self.m.flow_queue_size.labels(str(priority)).set(size)

    def dispatched(self, priority: int, waited_s: float) -> None:
        self.m.flow_dispatched.labels(str(priority)).inc()
        self.m.flow_wait_seconds.labels(str(priority), "dispatched").observe(waited_s)

    def rejected(self, priority: int, reason: str, waited_s: float) -> None:
        self.m.flow_rejected.labels(str(priority), reason).inc()
        self.m.flow_wait_seconds.labels(str(priority), reason).observe(waited_s)

    def saturated(self, saturated: bool) -> None:
        self.m.flow_saturated.set(1 if saturated else 0)
