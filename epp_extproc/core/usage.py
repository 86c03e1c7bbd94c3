"""Watching a response go by: end of prefill, and the usage the worker reports.

The observer never holds the stream back: it is handed each chunk after the chunk was already passed on.
SSE streams are scanned line by line and only lines that mention "usage" are parsed; unary JSON bodies are
kept (up to a cap) and parsed once at the end.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from epp_extproc.core.decision import Decision
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
        if self.sse and not self._buf and data.endswith(b"\n") and b'"usage"' not in data:
            return  # the usual SSE chunk: whole events, none with usage (a split "usage" needs a tail)
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

    def finish(self) -> bool:
        """Record the usage seen in the response; False when the response carried none (yet)."""
        if not self.sse and self._buf and not self._overflow:
            self._take(bytes(self._buf))
        elif self.sse and self._buf:
            self._scan_lines_final()
        self._buf = bytearray()
        if self.usage is None:
            return False
        record_usage(self.metrics, self.labels(self.decision.model), self.decision.predicted_cached_tokens,
                     self.usage, "sse" if self.sse else "unary")
        return True

    def _scan_lines_final(self) -> None:
        self._buf += b"\n"
        self._scan_lines()


def record_usage(metrics: PickerMetrics, model: str, predicted: int | None, usage: dict[str, Any],
                 kind: str) -> None:
    """One response's usage into the metrics: the same figures whether it was read from the echoed chunks
    (GAIE mode) or from Envoy's access log (lean mode)."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int) and prompt >= 0:
        metrics.prompt_tokens.labels(model).inc(prompt)
    if not isinstance(cached, int) or cached < 0:
        metrics.usage_observed.labels("no_cached_tokens").inc()
        return
    metrics.usage_observed.labels(kind).inc()
    metrics.cached_tokens.labels(model).observe(cached)
    if predicted is not None:
        metrics.predicted_cached_tokens.labels(model).observe(predicted)
        metrics.cache_prediction_error.observe(cached - predicted)


def usage_from_tail(text: bytes) -> dict[str, Any] | None:
    """The `usage` object from what follows the last `"usage"` member of an answer (the access-log path):
    `"usage":{...}` possibly followed by the rest of the JSON or SSE stream."""
    start = text.find(b"{")
    if not text.startswith(b'"usage"') or start < 0:
        return None
    try:
        doc, _ = _decoder.raw_decode(text[start:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


_decoder = json.JSONDecoder()
