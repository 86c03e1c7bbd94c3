"""``usage`` in a disaggregated answer: what it counts, and the rewrite that makes it so.

Definition (docs/pd-sidecar.md): in the final answer of a disaggregated request, ``prompt_tokens`` is the
prompt's length, ``completion_tokens`` every generated token (the first one, sampled by the prefill worker,
included), and ``prompt_tokens_details.cached_tokens`` the prompt tokens the PREFILL worker served from its
own cache, i.e. the prefix computation the pool avoided. Blocks the decode worker received over the KV
transfer are not a cache hit. llm-d's sidecar rewrites it the same way (``cached_tokens_usage_rewriter.go``:
the prefiller's ``cached_tokens``, 0 when vLLM sends null details); TensorRT-LLM's generation worker does it
itself when the generation leg carries ``ctx_usage`` (TensorRT-LLM PR #14177), and the rewrite below makes it
hold for an engine that does not.
"""

from __future__ import annotations

from typing import Any

import orjson


def cached_tokens(answer: dict[str, Any]) -> int:
    """The ``cached_tokens`` of an answer (0 when absent or null, as vLLM sends it for no hit)."""
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    v = details.get("cached_tokens") if isinstance(details, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def set_cached(doc: dict[str, Any], cached: int) -> bool:
    """Set ``usage.prompt_tokens_details.cached_tokens``; False when the document carries no usage."""
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    else:
        details["cached_tokens"] = cached
    return True


def rewrite_json(body: bytes, cached: int) -> bytes:
    """A whole JSON answer with ``cached_tokens`` set; unchanged bytes when it is not one or has no usage."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(doc, dict) or not set_cached(doc, cached):
        return body
    return orjson.dumps(doc)


class SseUsageRewriter:
    """Rewrites ``cached_tokens`` in the ``data:`` lines of an SSE stream that carry a usage object, passing
    every other byte through as it came. Only lines with ``"usage"`` in them are parsed (the usage chunk, or
    every chunk under ``continuous_usage_stats``), so a stream costs one substring search per line."""

    def __init__(self, cached: int, max_line: int = 1 << 20) -> None:
        self.cached = cached
        self.max_line = max_line
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send now: every complete line, rewritten where needed; a partial line waits."""
        data = self._buf + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            if len(data) > self.max_line:  # not SSE as we know it: stop holding bytes back
                self._buf = b""
                return data
            self._buf = data
            return b""
        self._buf = data[cut + 1:]
        return b"".join(self._line(line) for line in data[: cut + 1].splitlines(keepends=True))

    def flush(self) -> bytes:
        """Whatever partial line is left at the end of the stream."""
        rest, self._buf = self._buf, b""
        return self._line(rest) if rest else b""

    def _line(self, line: bytes) -> bytes:
        if not line.startswith(b"data:") or b'"usage"' not in line:
            return line
        body = line[5:].strip()
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return line
        if not isinstance(doc, dict) or not set_cached(doc, self.cached):
            return line
        ending = line[len(line.rstrip(b"\r\n")):]
        return b"data: " + orjson.dumps(doc) + ending
