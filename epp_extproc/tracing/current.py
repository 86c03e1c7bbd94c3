"""The sampled request whose decision is running, if any: set by the edge around the decision
(`spans.ExchangeSpan.attach`), read by the stage wrappers and by the log filter (`logs.TraceIds`). A plain
ContextVar of its own, without OpenTelemetry's context: one lookup, and importing it imports nothing else."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

CURRENT: ContextVar[Any] = ContextVar("epp_trace", default=None)  # a spans.ExchangeSpan, or None
