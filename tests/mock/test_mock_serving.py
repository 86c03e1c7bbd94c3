"""Serving behaviour: SSE streaming, batch-size queueing, headers, metrics and the stand-alone CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import aiohttp
import pytest

from tests.mock.test_mock_support import chat_body, ids_body, post, running_worker
from tests.netutil import free_port

HEADER = "x-trtllm-mock-worker"


async def sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    """All ``data:`` payloads of an SSE response, in order."""
    text = (await resp.read()).decode()
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


async def wait_for_metric(session: aiohttp.ClientSession, url: str, name: str, value: float) -> None:
    """Poll until a gauge reaches a value (bounded by the test timeout, never asserted on time)."""
    while await metric(session, url, name) != value:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("GET", "/does-not-exist", None),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": [], "nvext": None}),
        ("POST", "/v1/chat/completions", chat_body("hi")),
        ("POST", "/v1/chat/completions", chat_body("hi", stream=True)),
        ("GET", "/v1/chat/completions", None),
    ],
)
async def test_every_response_carries_the_worker_name_header(method, path, body):
    async with running_worker(name="w-7", kv_events=False) as w, aiohttp.ClientSession() as s:
        async with s.request(method, w.url + path, json=body) as r:
            await r.read()
            assert r.headers.get(HEADER) == "w-7"


async def test_sse_first_chunk_arrives_before_the_stream_ends():
    async with running_worker(kv_events=False, decode_ms_per_token=20.0) as w, aiohttp.ClientSession() as s:
        req = chat_body("stream me", stream=True, max_tokens=1000)  # would take 20 s to finish
        async with s.post(w.url + "/v1/chat/completions", json=req) as r:
            first = await r.content.readline()
            assert first.startswith(b"data: ")
            assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
            assert not r.content.at_eof()
            assert await metric(s, w.url, "trtllm_num_requests_running") == 1


async def test_client_disconnect_frees_the_running_slot():
    async with running_worker(kv_events=False, decode_ms_per_token=20.0) as w, aiohttp.ClientSession() as s:
        async with s.post(w.url + "/v1/chat/completions", json=chat_body("x", stream=True, max_tokens=1000)) as r:
            await r.content.readline()
            r.close()
        await wait_for_metric(s, w.url, "trtllm_num_requests_running", 0)
        async with s.get(w.url + "/mock/cache") as c:
            assert (await c.json())["private_blocks"] == 0


async def test_stream_sends_usage_in_the_last_chunk_then_done():
    async with running_worker(kv_events=False) as w, aiohttp.ClientSession() as s:
        req = chat_body("hi", stream=True, max_tokens=3, stream_options={"include_usage": True})
        async with s.post(w.url + "/v1/chat/completions", json=req) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = await sse_events(r)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    content_chunks = [json.loads(e) for e in events[:-2]]
    assert all("usage" not in c for c in content_chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks)
    assert content_chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_stream_without_stream_options_has_no_usage_chunk():
    async with running_worker(kv_events=False) as w, aiohttp.ClientSession() as s:
        async with s.post(w.url + "/v1/chat/completions", json=chat_body("hi", stream=True, max_tokens=2)) as r:
            events = await sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


async def test_streamed_usage_reports_cached_tokens():
    async with running_worker(kv_events=False, tokens_per_block=4) as w, aiohttp.ClientSession() as s:
        prompt = list(range(100, 109))
        await post(s, w.url + "/v1/chat/completions", ids_body(prompt))
        req = ids_body(prompt, stream=True, stream_options={"include_usage": True})
        async with s.post(w.url + "/v1/chat/completions", json=req) as r:
            events = await sse_events(r)
    assert json.loads(events[-2])["usage"]["prompt_tokens_details"]["cached_tokens"] == 8


async def test_completions_stream_sends_text_chunks():
    async with running_worker(kv_events=False) as w, aiohttp.ClientSession() as s:
        req = {"model": "m", "prompt": "once upon", "stream": True, "max_tokens": 4}
        async with s.post(w.url + "/v1/completions", json=req) as r:
            events = await sse_events(r)
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 4
    assert all(c["choices"][0]["text"] for c in chunks)


async def test_requests_beyond_max_batch_size_wait_in_the_queue():
    async with (
        running_worker(kv_events=False, max_batch_size=1, decode_ms_per_token=20.0) as w,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(w.url + "/v1/chat/completions", json=chat_body("a", stream=True, max_tokens=1000)) as r:
            await r.content.readline()  # first request is running
            queued = asyncio.create_task(post(s, w.url + "/v1/chat/completions", chat_body("b", max_tokens=1)))
            await wait_for_metric(s, w.url, "trtllm_num_requests_waiting", 1)
            assert await metric(s, w.url, "trtllm_num_requests_running") == 1
            assert not queued.done()
            r.close()
        status, body = await queued
    assert status == 200 and body["usage"]["completion_tokens"] == 1


async def test_request_waits_for_kv_capacity_not_only_batch_slots():
    async with (
        running_worker(kv_events=False, tokens_per_block=4, num_blocks=4, decode_ms_per_token=20.0) as w,
        aiohttp.ClientSession() as s,
    ):
        big = ids_body(list(range(100, 108)), stream=True, max_tokens=8)  # 4 blocks: the whole cache
        async with s.post(w.url + "/v1/chat/completions", json=big) as r:
            await r.content.readline()
            queued = asyncio.create_task(post(s, w.url + "/v1/chat/completions", ids_body([5, 6, 7], max_tokens=1)))
            await wait_for_metric(s, w.url, "trtllm_num_requests_waiting", 1)
            r.close()
        status, _ = await queued
    assert status == 200


async def test_metrics_expose_trtllm_names_and_request_counters():
    async with running_worker(kv_events=False, enable_render_endpoints=True, num_blocks=100) as w:
        async with aiohttp.ClientSession() as s:
            await post(s, w.url + "/v1/chat/completions", chat_body("hi"))
            await post(s, w.url + "/v1/chat/completions/render", chat_body("hi"))
            async with s.get(w.url + "/metrics") as r:
                text = await r.text()
    for name in (
        "trtllm_num_requests_waiting",
        "trtllm_num_requests_running",
        "trtllm_kv_cache_utilization",
        "trtllm_kv_cache_tokens_per_block 32.0",
        "trtllm_kv_cache_max_blocks 100.0",
        'trtllm_mock_inference_requests_total{route="chat"} 1.0',
        'trtllm_mock_render_requests_total{route="chat"} 1.0',
    ):
        assert name in text


async def test_two_workers_in_one_process_keep_separate_metrics():
    async with running_worker(kv_events=False) as a, running_worker(kv_events=False) as b:
        async with aiohttp.ClientSession() as s:
            await post(s, a.url + "/v1/chat/completions", chat_body("hi"))
            async with s.get(b.url + "/metrics") as r:
                assert "trtllm_mock_inference_requests_total{" not in await r.text()


async def test_worker_server_info_reports_live_cache_settings():
    async with running_worker(kv_events=False, tokens_per_block=64, max_batch_size=8) as w:
        async with aiohttp.ClientSession() as s, s.get(w.url + "/server_info") as r:
            info = await r.json()
    assert info["tokens_per_block"] == 64 and info["max_batch_size"] == 8
    assert info["kv_cache_hash_algo"] == "v1_block_key" and info["disaggregated_params"] is None
    assert len(info["render_fingerprint"]["digest"]) == 64


async def test_models_lists_the_served_model():
    async with running_worker(kv_events=False, model="llama-mock") as w:
        async with aiohttp.ClientSession() as s, s.get(w.url + "/v1/models") as r:
            body = await r.json()
    assert [m["id"] for m in body["data"]] == ["llama-mock"]


async def test_cli_prints_its_endpoints_and_stops_cleanly_on_sigterm():
    port, kv, rp = free_port(), free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trtllm_mock", "--port", str(port), "--name", "cli-w",
        "--kv-events-endpoint", f"tcp://127.0.0.1:{kv}", "--replay-endpoint", f"tcp://127.0.0.1:{rp}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )  # fmt: skip
    assert proc.stdout is not None
    lines = [(await asyncio.wait_for(proc.stdout.readline(), 20)).decode() for _ in range(3)]
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health") as r:
        assert r.headers[HEADER] == "cli-w"
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 20) == 0
    assert f"http://127.0.0.1:{port}" in lines[0]
    assert f"KV events tcp://127.0.0.1:{kv}" in lines[1]
    assert f"replay tcp://127.0.0.1:{rp}" in lines[2]
