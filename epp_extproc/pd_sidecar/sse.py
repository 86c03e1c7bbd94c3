"""A finished non-streamed answer as the SSE stream a streaming client expects.

Needed when the context leg's answer is already final (its first token ended the request): TensorRT-LLM's
own orchestrator answers a streaming client with an empty generator there (``done_generator()`` in
``openai_disagg_service.py``); the sidecar sends the answer's content instead, shaped like trtllm-serve's
stream (role chunk, content chunk with the finish reason, a usage chunk when ``stream_options.include_usage``,
``[DONE]``).
"""

from __future__ import annotations

from typing import Any

import orjson


def _frame(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def answer_as_sse(answer: dict[str, Any], chat: bool, include_usage: bool) -> bytes:
    """The whole stream for ``answer`` (a chat.completion or text_completion object)."""
    head = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    obj = "chat.completion.chunk" if chat else "text_completion"
    out = []
    for c in answer.get("choices") or []:
        if not isinstance(c, dict):
            continue
        idx = c.get("index", 0)
        if chat:
            msg = c.get("message") or {}
            out.append(_frame({**head, "object": obj, "choices": [
                {"index": idx, "delta": {"role": msg.get("role", "assistant"), "content": ""}, "logprobs": None,
                 "finish_reason": None}]}))
            out.append(_frame({**head, "object": obj, "choices": [
                {"index": idx, "delta": {"content": msg.get("content") or ""}, "logprobs": c.get("logprobs"),
                 "finish_reason": c.get("finish_reason")}]}))
        else:
            out.append(_frame({**head, "object": obj, "choices": [
                {"index": idx, "text": c.get("text", ""), "logprobs": c.get("logprobs"),
                 "finish_reason": c.get("finish_reason")}]}))
    if include_usage and isinstance(answer.get("usage"), dict):
        out.append(_frame({**head, "object": obj, "choices": [], "usage": answer["usage"]}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)
