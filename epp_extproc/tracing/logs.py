"""Trace ids in log lines: only OpenTelemetry's API (a context lookup), never the SDK, so the JSON log format
costs nothing more when tracing is off (no span is ever current then)."""

from __future__ import annotations

import logging

from opentelemetry import trace


class TraceIds(logging.Filter):
    """Records made while a request's span is current carry its `trace_id` and `span_id` (JSON logs add them as
    fields), so a decision or error line leads to its trace and back."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            record.trace_id = format(ctx.trace_id, "032x")
            record.span_id = format(ctx.span_id, "016x")
        return True
