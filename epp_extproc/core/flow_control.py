"""Flow control: hold requests in the picker while every worker is saturated, and release them in order.

Without it, every request goes straight to a worker even when all of them are full, and the queue builds
inside the engines, where nothing can reorder it by priority or share it fairly between tenants. With it:

* `SaturationDetector` judges each worker from its own Prometheus gauges (scraped by
  adapters/worker_metrics.py) corrected by this picker's bookings since the scrape, and the pool as
  saturated when every eligible worker is.
* `FlowController` queues requests while the pool is saturated: priority bands (an InferenceObjective's
  `spec.priority`, higher first), round robin between fairness ids inside a band, FIFO inside one fairness
  id. A request waits at most `ttl_s` (then 429, or 503 when the pool has no endpoint at all); a sheddable
  request (priority < 0) is never queued: 429 at once while saturated. A client that goes away while
  queued (its task is cancelled) leaves nothing behind.

Pure asyncio over plain values: no grpc, no aiohttp. The semantics follow the Gateway API Inference
Extension (GAIE) / llm-d flow control, including its `x-llm-d-request-dropped-reason` values.

One job per module: `core/flow_objectives.py` (flow keys, the objective table), `core/saturation.py` (the
detector), `core/flow_queue.py` (the queue and its admission). This module re-exports their names for the
modules and tests that import them from here.
"""

from __future__ import annotations

from epp_extproc.core.flow_objectives import (
    DEFAULT_FLOW,
    FAIRNESS_HEADERS,
    MAX_ID_CHARS,
    OBJECTIVE_HEADERS,
    FlowKey,
    ObjectiveTable,
    parse_objectives,
)
from epp_extproc.core.flow_queue import (
    DROPPED_REASON_HEADER,
    MAX_SERVED_FLOWS,
    REASON_NO_ENDPOINTS,
    REASON_SATURATED,
    REASON_SHUTDOWN,
    REASON_TTL,
    FlowController,
    FlowMetrics,
    FlowRejection,
    Ticket,
    reason_of,
)
from epp_extproc.core.saturation import SaturationDetector, Thresholds, WorkerSample, WorkerState

__all__ = ["DEFAULT_FLOW", "DROPPED_REASON_HEADER", "FAIRNESS_HEADERS", "MAX_ID_CHARS", "MAX_SERVED_FLOWS",
           "OBJECTIVE_HEADERS", "REASON_NO_ENDPOINTS", "REASON_SATURATED", "REASON_SHUTDOWN", "REASON_TTL",
           "FlowController", "FlowKey", "FlowMetrics", "FlowRejection", "ObjectiveTable", "SaturationDetector",
           "Thresholds", "Ticket", "WorkerSample", "WorkerState", "parse_objectives", "reason_of"]
