"""Trace ids in log lines: a ContextVar lookup (tracing/current.py), never the SDK, so the JSON log format
costs nothing more when tracing is off (no request is ever current then)."""

from __future__ import annotations

import logging

from epp_extproc.tracing.current import CURRENT


class TraceIds(logging.Filter):
    """Records made while a sampled request is decided or refused carry its `trace_id` and `span_id` (JSON
    logs add them as fields), so a decision or error line leads to its trace and back."""

    def filter(self, record: logging.LogRecord) -> bool:
        rec = CURRENT.get()
        if rec is not None:
            record.trace_id = f"{rec.trace_id:032x}"
            record.span_id = f"{rec.span_id:016x}"
        return True
