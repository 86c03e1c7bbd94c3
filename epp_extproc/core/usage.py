"""Watching a response go by: end of prefill, and the usage the worker reports.

The observer never holds the stream back: it is handed each chunk after the chunk was already passed on.
SSE streams are scanned line by line and only lines that mention "usage" are parsed; unary JSON bodies are
kept (up to a cap) and parsed once at the end.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from epp_extproc.core.pipeline import Decision
from epp_extproc.metrics import PickerMetrics

log = logging.getLogger(__name__)

MAX_UNARY_BYTES = 8 * 1024 * 1024
MAX_MODEL_LABELS = 64


class ModelLabels:
    """Bounded label values: a client cannot explode metric cardinality by inventing model names."""

    def __init__(self, limit: int = MAX_MODEL_LABELS) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def __call__(self, model: str | None) -> str:
        m = (model or "unknown")[:128]
        if m in self.seen:
            return m
        if len(self.seen) < self.limit:
            self.seen.add(m)
            return m
        return "other"


class UsageObserver:
    def __init__(self, decision: Decision, metrics: PickerMetrics, labels: ModelLabels) -> None:
        self.decision = decision
        self.metrics = metrics
        self.labels = labels
        self.sse = False
        self.status = 0
        self.usage: dict[str, Any] | None = None
        self._buf = bytearray()
        self._overflow = False

    def on_headers(self, headers: dict[str, list[str]]) -> None:
        ctype = (headers.get("content-type") or [""])[-1].lower()
        self.sse = "text/event-stream" in ctype
        try:
            self.status = int((headers.get(":status") or ["0"])[-1])
        except ValueError:
            self.status = 0

    def on_chunk(self, data: bytes) -> None:
        if self._overflow:
            return
        self._buf += data
        if self.sse:
            self._scan_lines()
        elif len(self._buf) > MAX_UNARY_BYTES:
            self._overflow = True
            self._buf = bytearray()

    def _scan_lines(self) -> None:
        buf = self._buf
        end = buf.rfind(b"\n")
        if end < 0:
            if len(buf) > MAX_UNARY_BYTES:
                self._overflow = True
                self._buf = bytearray()
            return
        lines, self._buf = bytes(buf[:end]), bytearray(buf[end + 1:])
        for line in lines.split(b"\n"):
            if line.startswith(b"data:") and b'"usage"' in line:
                self._take(line[5:].strip())

    def _take(self, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
        except ValueError:
            return
        if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
            self.usage = doc["usage"]

    def finish(self) -> None:
        if not self.sse and self._buf and not self._overflow:
            self._take(bytes(self._buf))
        elif self.sse and self._buf:
            self._scan_lines_final()
        self._buf = bytearray()
        if self.usage is None:
            return
        details = self.usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        model = self.labels(self.decision.model)
        prompt = self.usage.get("prompt_tokens")
        if isinstance(prompt, int) and prompt >= 0:
            self.metrics.prompt_tokens.labels(model).inc(prompt)
        if not isinstance(cached, int) or cached < 0:
            self.metrics.usage_observed.labels("no_cached_tokens").inc()
            return
        self.metrics.usage_observed.labels("sse" if self.sse else "unary").inc()
        self.metrics.cached_tokens.labels(model).observe(cached)
        predicted = self.decision.predicted_cached_tokens
        if predicted is not None:
            self.metrics.predicted_cached_tokens.labels(model).observe(predicted)
            self.metrics.cache_prediction_error.observe(cached - predicted)

    def _scan_lines_final(self) -> None:
        self._buf += b"\n"
        self._scan_lines()
