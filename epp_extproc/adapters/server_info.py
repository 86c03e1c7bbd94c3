"""What a worker says about itself over HTTP: its KV block size and the LoRA adapters it serves.

Each engine says it somewhere else, so the probes try, in order, the places that exist and treat a 404 as "not
here" (never as a warning: vLLM answers ``/server_info`` with 404 on every worker, and a warning per worker per
discovery change would be a storm):

* block size: TensorRT-LLM ``/server_info`` (``tokens_per_block``), SGLang ``/get_server_info``
  (``page_size``), then ``/metrics``: vLLM's ``vllm:cache_config_info{block_size="16",...}`` info gauge or
  ``trtllm_kv_cache_tokens_per_block``.  When none says, the index learns the size from the first event.
* adapters: ``/v1/models`` entries with a ``parent`` (vLLM lists each loaded LoRA adapter as a model whose
  parent is the base model); a request whose ``model`` names one of them is hashed with that adapter.

This module is the one reader of ``/server_info`` (`read_server_info`: the render fingerprint watcher asks
it too); ``/metrics`` it asks of `worker_metrics.read_metrics`, the one reader of that. Every GET goes
through `worker_http.WorkerHttp`.
"""

from __future__ import annotations

import logging
import re

import orjson

from epp_extproc.adapters.worker_http import HttpError, WorkerHttp
from epp_extproc.adapters.worker_metrics import MetricsError, read_metrics

log = logging.getLogger(__name__)

_VLLM_BLOCK = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.M)
_TRTLLM_BLOCK = re.compile(r"^trtllm_kv_cache_tokens_per_block(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)
_MAX_BODY = 4 * 1024 * 1024  # a worker's /metrics is a few hundred kB; never buffer an endless answer
MAX_SERVER_INFO_BYTES = 1 << 20


async def read_server_info(http: WorkerHttp, address: str, *,
                           max_bytes: int = MAX_SERVER_INFO_BYTES) -> tuple[str, object | None]:
    """The one read of a worker's `/server_info` (block size here, the render fingerprint watcher too).

    (outcome, document): outcome `ok` (a 200 whose body is JSON), `missing` (404, or a 200 that is not
    JSON: the worker has no such document) or `error` (no usable answer: refused, timeout, 5xx, too large).
    """
    try:
        r = await http.get(address, "/server_info", max_body=max_bytes)
    except HttpError:
        return "error", None
    if r.status != 200:
        return ("missing" if r.status == 404 else "error"), None
    try:
        return "ok", orjson.loads(r.body)
    except orjson.JSONDecodeError:
        return "missing", None


async def _get_json(http: WorkerHttp, address: str, path: str) -> object | None:
    try:
        r = await http.get(address, path, max_body=_MAX_BODY)
    except HttpError:
        return None
    if r.status != 200:
        return None
    try:
        return orjson.loads(r.body)
    except orjson.JSONDecodeError:
        return None


def _positive(n: object) -> int | None:
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 1 << 16 else None


def block_size_from_metrics(text: str) -> int | None:
    """The block size a Prometheus exposition names (vLLM's cache_config_info, TensorRT-LLM's gauge)."""
    m = _VLLM_BLOCK.search(text)
    if m:
        return _positive(int(m.group(1)))
    m = _TRTLLM_BLOCK.search(text)
    if m:
        try:
            return _positive(int(float(m.group(1))))
        except ValueError:
            return None
    return None


async def fetch_block_size(address: str, timeout_s: float = 2.0, *, http: WorkerHttp | None = None) -> int | None:
    """A worker's live tokens per KV block, or None when it does not say anywhere we look."""
    own = http is None
    client = http or WorkerHttp(timeout_s=timeout_s, max_body=_MAX_BODY)
    try:
        _, doc = await read_server_info(client, address)
        if isinstance(doc, dict) and (n := _positive(doc.get("tokens_per_block"))):
            return n
        doc = await _get_json(client, address, "/get_server_info")
        if isinstance(doc, dict) and (n := _positive(doc.get("page_size"))):
            return n
        try:
            text = await read_metrics(client, address, max_bytes=_MAX_BODY)
        except (HttpError, MetricsError):
            return None
        return block_size_from_metrics(text)
    finally:
        if own:
            await client.close()


async def fetch_served_adapters(address: str, timeout_s: float = 2.0, *,
                                http: WorkerHttp | None = None) -> dict[str, str] | None:
    """The LoRA adapters a worker serves (``/v1/models`` entries with a parent), each with its base model;
    None if unknown."""
    client = http or WorkerHttp(timeout_s=timeout_s, max_body=_MAX_BODY)
    try:
        doc = await _get_json(client, address, "/v1/models")
    finally:
        if http is None:
            await client.close()
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return None
    return {m["id"]: m["parent"] for m in doc["data"]
            if isinstance(m, dict) and isinstance(m.get("id"), str) and isinstance(m.get("parent"), str)
            and m["parent"]}
