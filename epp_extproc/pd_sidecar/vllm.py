"""vLLM's two-step NIXL handoff (``kv_transfer_params``), as llm-d's sidecar runs it.

Source: llm-d/llm-d-inference-scheduler ``pkg/sidecar/proxy/connector_nixlv2.go`` (commit 520af478): the
prefill leg is the client's request with ``kv_transfer_params = {do_remote_decode: true, do_remote_prefill:
false, remote_engine_id/remote_block_ids/remote_host/remote_port: null}``, ``stream: false``, no
``stream_options``, ``max_tokens`` and ``max_completion_tokens`` 1; the decode leg is the client's request
with the prefill answer's ``kv_transfer_params``. vLLM's side (``vllm/distributed/kv_transfer/kv_connector/v1/
nixl/pull_scheduler.py``, vLLM 0.32.0) answers ``do_remote_prefill: true``, ``remote_block_ids``,
``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size``; the decode worker
pulls those blocks, skipping the ones it already holds.
"""

from __future__ import annotations

from typing import Any

TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    out["stream"] = False
    for f in TOKEN_LIMIT_FIELDS:
        out[f] = 1
    return out


def decode_request(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The decode leg: the client's request plus the returned parameters (llm-d sends whatever came back,
    null included, and only logs a missing field)."""
    out = dict(body)
    out["kv_transfer_params"] = prefill_answer.get("kv_transfer_params")
    return out
