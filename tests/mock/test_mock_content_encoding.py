"""Encoded request bodies: trtllm-serve (uvicorn + FastAPI) never decodes `Content-Encoding`, so the mock must
not either (aiohttp's server would, and the mock would accept what the real server rejects).

Measured against FastAPI 0.165 / Starlette 1.10 with TensorRT-LLM's RequestValidationError handler: a gzip or
deflate body is 400 `{"detail": "There was an error parsing the body"}` (the bytes are not UTF-8, so FastAPI's
generic branch answers, not the validation handler); an uncompressed JSON body labelled `gzip` is served.
"""

from __future__ import annotations

import gzip
import json
import zlib

import aiohttp
import pytest

from tests.mock.test_mock_support import chat_body, running_worker

PARSE_ERROR = {"detail": "There was an error parsing the body"}


@pytest.mark.parametrize(("encoding", "encode"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render"])
async def test_compressed_body_is_rejected_like_fastapi_not_decoded(encoding, encode, path):
    raw = json.dumps(chat_body("hi")).encode()
    async with running_worker(kv_events=False, enable_render_endpoints=True) as w, aiohttp.ClientSession(
            auto_decompress=False) as s:
        async with s.post(w.url + path, data=encode(raw), headers={
                "content-type": "application/json", "content-encoding": encoding}) as r:
            assert r.status == 400
            assert r.headers["content-type"].startswith("application/json")
            assert await r.json() == PARSE_ERROR


async def test_plain_json_labelled_gzip_is_served_because_the_label_is_ignored():
    raw = json.dumps(chat_body("hi")).encode()
    async with running_worker(kv_events=False) as w, aiohttp.ClientSession() as s:
        async with s.post(w.url + "/v1/chat/completions", data=raw, headers={
                "content-type": "application/json", "content-encoding": "gzip"}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["usage"]["completion_tokens"] > 0


async def test_malformed_utf8_json_is_still_the_validation_error_shape():
    """Valid UTF-8 that is not JSON stays TensorRT-LLM's own handler shape (400 {"error": ...})."""
    async with running_worker(kv_events=False) as w, aiohttp.ClientSession() as s:
        async with s.post(w.url + "/v1/chat/completions", data=b"{not json",
                          headers={"content-type": "application/json"}) as r:
            assert r.status == 400
            assert "JSON decode error" in (await r.json())["error"]
