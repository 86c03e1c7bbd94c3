"""TensorRT-LLM's context-first handoff over its OpenAI HTTP API, as ``trtllm-serve disaggregated`` runs it.

Pinned: TensorRT-LLM 1.3.0rc27 (see docs/pd-sidecar.md for how that was checked). Every field below is one of
``DisaggregatedParams`` in ``tensorrt_llm/serve/openai_protocol.py``, and the two request shapes are those of
``tensorrt_llm/serve/openai_disagg_service.py`` (``_get_ctx_request``, ``_get_gen_request``, ``_need_gen``):

* context leg: the client's request with ``disaggregated_params = {request_type: "context_only",
  disagg_request_id}``, ``stream: false``, no ``stream_options``, ``max_tokens`` untouched;
* generation leg: the client's request with the context answer's ``choices[0].disaggregated_params``, its
  ``request_type`` set to ``"generation_only"``, ``ctx_usage`` = the context answer's ``usage``, the same
  ``disagg_request_id``, and the context answer's ``prompt_token_ids`` (chat: ``prompt_token_ids``;
  completions: ``prompt``), so the generation worker does not tokenize again;
* a context answer whose finish reason is neither ``length`` nor ``not_finished`` is the final answer.

``DisaggregatedParams`` forbids extra fields, so the sidecar sends nothing it did not get from the engine
except ``request_type``, ``disagg_request_id`` and ``ctx_usage`` (all in the pinned model).
"""

from __future__ import annotations

import secrets
from typing import Any

NEEDS_GENERATION = ("length", "not_finished")
# tensorrt_llm/llmapi/disagg_utils.py: global disagg ids live in [MIN_GLOBAL_ID, 2**63); ids below it are
# an engine's local ones.
MIN_GLOBAL_ID = 1 << 40


def new_disagg_request_id() -> int:
    """A ``disagg_request_id`` no other sidecar will pick: 62 random bits above 2**62 (inside TensorRT-LLM's
    global range). TensorRT-LLM's own snowflake needs a node id per orchestrator, which independent
    sidecars do not have; with 62 random bits a collision among a million ids in flight has probability
    below 1e-7."""
    return (1 << 62) | secrets.randbits(62)


def is_image_request(body: dict[str, Any]) -> bool:
    """A chat request with a non-text content part: TensorRT-LLM's disaggregated OpenAI protocol carries no
    multimodal handles (the TODO(TRTLLM-12407) in ``DisaggregatedParams``), so these stay decode-local."""
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type", "text") != "text":
                    return True
    return False


def local_reason(path: str, body: dict[str, Any]) -> str | None:
    """Why a request cannot be disaggregated on a TensorRT-LLM pool (None: it can)."""
    if is_image_request(body):
        return "image"
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt) and len(prompt) > 1:
            return "multi_prompt"  # openai_disagg_service.openai_completion refuses these too
    if isinstance(body.get("disaggregated_params"), dict):
        return "client_disaggregated_params"  # never relay a client's own handoff
    return None


def context_request(body: dict[str, Any], disagg_request_id: int) -> dict[str, Any]:
    """The context-only leg (``_get_ctx_request``)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["stream"] = False
    out["disaggregated_params"] = {"request_type": "context_only", "disagg_request_id": disagg_request_id}
    return out


def is_final(ctx: dict[str, Any]) -> bool:
    """``_need_gen``: the context answer is already complete."""
    choices = ctx.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    return choices[0].get("finish_reason") not in NEEDS_GENERATION


def final_answer(ctx: dict[str, Any]) -> dict[str, Any]:
    """The context answer as the client's answer: without the handoff fields the client never asked for."""
    out = {k: v for k, v in ctx.items() if k != "prompt_token_ids"}
    out["choices"] = [{k: v for k, v in c.items() if k != "disaggregated_params"} if isinstance(c, dict) else c
                      for c in ctx.get("choices", [])]
    return out


class BadContextAnswer(Exception):
    """The context worker's answer lacks what the generation leg needs."""


def generation_request(body: dict[str, Any], path: str, ctx: dict[str, Any], disagg_request_id: int,
                       ctx_usage: bool = True) -> dict[str, Any]:
    """The generation-only leg (``_get_gen_request``). ``ctx_usage=False`` for a release whose
    ``DisaggregatedParams`` has no such field (it forbids unknown ones: the leg would be a 400)."""
    try:
        dp = dict(ctx["choices"][0]["disaggregated_params"])
    except (KeyError, IndexError, TypeError):
        raise BadContextAnswer("context answer has no choices[0].disaggregated_params") from None
    dp["request_type"] = "generation_only"
    dp["disagg_request_id"] = disagg_request_id
    if ctx_usage and isinstance(ctx.get("usage"), dict):
        dp["ctx_usage"] = ctx["usage"]
    out = dict(body)
    out["disaggregated_params"] = dp
    ids = ctx.get("prompt_token_ids")
    if ids is not None:
        if path.endswith("/chat/completions"):
            out["prompt_token_ids"] = ids
        else:
            out["prompt"] = ids
    return out
