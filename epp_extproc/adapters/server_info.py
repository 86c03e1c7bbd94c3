"""What a worker says about itself over HTTP: its KV block size and the LoRA adapters it serves.

Each engine says it somewhere else, so the probes try, in order, the places that exist and treat a 404 as "not
here" (never as a warning: vLLM answers ``/server_info`` with 404 on every worker, and a warning per worker per
discovery change would be a storm):

* block size: TensorRT-LLM ``/server_info`` (``tokens_per_block``), SGLang ``/get_server_info``
  (``page_size``), then ``/metrics``: vLLM's ``vllm:cache_config_info{block_size="16",...}`` info gauge or
  ``trtllm_kv_cache_tokens_per_block``.  When none says, the index learns the size from the first event.
* adapters: ``/v1/models`` entries with a ``parent`` (vLLM lists each loaded LoRA adapter as a model whose
  parent is the base model); a request whose ``model`` names one of them is hashed with that adapter.
"""

from __future__ import annotations

import logging
import re

import aiohttp

log = logging.getLogger(__name__)

_VLLM_BLOCK = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.M)
_TRTLLM_BLOCK = re.compile(r"^trtllm_kv_cache_tokens_per_block(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)
_MAX_BODY = 4 * 1024 * 1024  # a worker's /metrics is a few hundred kB; never buffer an endless answer


async def _get(s: aiohttp.ClientSession, url: str, *, as_json: bool) -> object | None:
    try:
        async with s.get(url, allow_redirects=False) as r:
            if r.status != 200:
                return None
            body = await r.content.read(_MAX_BODY)
    except (aiohttp.ClientError, TimeoutError):
        return None
    if not as_json:
        return body.decode("utf-8", "replace")
    try:
        import orjson

        return orjson.loads(body)
    except ValueError:
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


async def fetch_block_size(address: str, timeout_s: float = 2.0) -> int | None:
    """A worker's live tokens per KV block, or None when it does not say anywhere we look."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        doc = await _get(s, f"http://{address}/server_info", as_json=True)
        if isinstance(doc, dict) and (n := _positive(doc.get("tokens_per_block"))):
            return n
        doc = await _get(s, f"http://{address}/get_server_info", as_json=True)
        if isinstance(doc, dict) and (n := _positive(doc.get("page_size"))):
            return n
        text = await _get(s, f"http://{address}/metrics", as_json=False)
        if isinstance(text, str):
            return block_size_from_metrics(text)
    return None


async def fetch_served_adapters(address: str, timeout_s: float = 2.0) -> dict[str, str] | None:
    """The LoRA adapters a worker serves (``/v1/models`` entries with a parent), each with its base model;
    None if unknown."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        doc = await _get(s, f"http://{address}/v1/models", as_json=True)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return None
    return {m["id"]: m["parent"] for m in doc["data"]
            if isinstance(m, dict) and isinstance(m.get("id"), str) and isinstance(m.get("parent"), str)
            and m["parent"]}
