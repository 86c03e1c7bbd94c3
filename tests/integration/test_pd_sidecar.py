"""`epp-pd-sidecar` as a process in front of a `trtllm-mock` decode worker, with a `trtllm-mock` context worker
and fake vLLM / failing prefill workers: every path of the handover, asserted on what each worker received."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from epp_extproc.dev import procs
from epp_extproc.dev.procs import Proc
from tests.harness import BackgroundLoop
from tests.integration.pd_fakes import (
    PREFILL_CACHED,
    VLLM_KV_TRANSFER_PARAMS,
    FailingPrefill,
    VllmDecode,
    VllmPrefill,
)
from tests.netutil import free_port
from tests.stack import MockProc
from trtllm_mock.tokenizer import output_token_ids

SIDECAR = str(Path(sys.executable).parent / "epp-pd-sidecar")
HEADER = "x-prefiller-host-port"


def sidecar_proc(name: str, logdir: Path, decode_url: str, engine: str, allowed: list[str],
                 args: tuple[str, ...] = ()) -> Proc:
    port = free_port()
    argv = [SIDECAR, "--host", "127.0.0.1", "--port", str(port), "--decode-url", decode_url, "--engine", engine,
            "--allowed-prefillers", ",".join(allowed), *args]
    return Proc(name, argv, port, logdir / f"{name}.log", ready_url=f"http://127.0.0.1:{port}/health")


@dataclass
class Pool:
    ctx: MockProc
    gen: MockProc
    trt: Proc
    vllm: Proc
    vllm_p: VllmPrefill
    vllm_d: VllmDecode
    fail503: FailingPrefill
    fail500: FailingPrefill
    hang: FailingPrefill
    dead: str


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    logdir = Path(tempfile.mkdtemp(prefix="pd-sidecar-"))
    bg = BackgroundLoop()
    fakes = [VllmPrefill(), VllmDecode(), FailingPrefill(), FailingPrefill(), FailingPrefill()]
    fakes[3].status = 500
    fakes[4].hang = True
    for f in fakes:
        bg.run(f.start())
    ctx = MockProc.of(procs.mock_worker("ctx", logdir, heartbeat_s=None))
    gen = MockProc.of(procs.mock_worker("gen", logdir, heartbeat_s=None, args=["--decode-ms-per-token", "1"]))
    dead = f"127.0.0.1:{free_port()}"
    trt = sidecar_proc("sidecar-trt", logdir, gen.url, "trtllm",
                       [ctx.address, fakes[2].address, fakes[3].address, fakes[4].address, dead],
                       ("--max-body-bytes", str(1 << 20)))
    vl = sidecar_proc("sidecar-vllm", logdir, f"http://{fakes[1].address}", "vllm", [fakes[0].address])
    started: list[Proc] = []
    try:
        for p in (ctx, gen, trt, vl):
            started.append(p.start())
        yield Pool(ctx, gen, trt, vl, *fakes, dead)  # type: ignore[arg-type]
    finally:
        for p in started:
            p.stop()
        for f in fakes:
            bg.run(f.stop())
        bg.close()


def chat(prompt: list[int], max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "prompt_token_ids": prompt,
            "max_tokens": max_tokens, **extra}


def ids(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


async def send(url: str, body: Any, headers: dict[str, str] | None = None, raw: bytes | None = None,
               path: str = "/v1/chat/completions") -> tuple[int, Any, str]:
    async with aiohttp.ClientSession() as s, s.post(url + path, data=raw if raw is not None else json.dumps(body),
                                                      headers={"content-type": "application/json",
                                                               **(headers or {})}) as r:
        text = await r.text()
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        return r.status, doc, text


def sse_docs(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def metric(p: Proc, name: str, **labels: str) -> float:
    import urllib.request
    with urllib.request.urlopen(p.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _raw(w: MockProc, path: str) -> bytes:
    import urllib.request
    with urllib.request.urlopen(w.url + path, timeout=10) as r:
        return r.read()


# ------------------------------------------------------------------------------------------------ no header
async def test_without_header_the_body_reaches_the_decode_worker_byte_for_byte(pool: Pool):
    raw = b'{"model":"mock-model",  "messages":[{"role":"user","content":"plain"}],"max_tokens":2 }'
    st, doc, _ = await send(pool.trt.url, None, raw=raw)
    assert st == 200 and doc["usage"]["completion_tokens"] == 2
    assert _raw(pool.gen, "/mock/last-request") == raw


async def test_without_header_a_stream_is_relayed_as_the_worker_sent_it(pool: Pool):
    body = chat(ids(40, 7000), stream=True, stream_options={"include_usage": True})
    st, _, through = await send(pool.trt.url, body)
    st2, _, direct = await send(pool.gen.url, body)
    strip = [{k: v for k, v in d.items() if k not in ("id", "created")} for d in sse_docs(through)]
    strip2 = [{k: v for k, v in d.items() if k not in ("id", "created")} for d in sse_docs(direct)]
    assert st == st2 == 200 and through.endswith("data: [DONE]\n\n")
    assert [d["choices"] for d in strip] == [d["choices"] for d in strip2]


# --------------------------------------------------------------------------------------------- TensorRT-LLM
async def test_trtllm_two_legs_answer_like_an_aggregated_worker(pool: Pool):
    prompt = ids(100, 10_000)
    st, doc, _ = await send(pool.trt.url, chat(prompt), {HEADER: pool.ctx.address})
    ctx_leg = json.loads(_raw(pool.ctx, "/mock/last-request"))
    gen_leg = json.loads(_raw(pool.gen, "/mock/last-request"))
    st2, agg, _ = await send(pool.ctx.url, chat(ids(100, 10_000)))
    assert st == 200 and st2 == 200, doc
    assert set(doc) == set(agg) and set(doc["choices"][0]) == set(agg["choices"][0])
    assert doc["choices"][0]["message"]["content"] == agg["choices"][0]["message"]["content"]
    assert ctx_leg["disaggregated_params"]["request_type"] == "context_only"
    assert ctx_leg["stream"] is False and ctx_leg["max_tokens"] == 4
    assert gen_leg["disaggregated_params"]["request_type"] == "generation_only"
    assert gen_leg["disaggregated_params"]["disagg_request_id"] == ctx_leg["disaggregated_params"]["disagg_request_id"]
    assert gen_leg["prompt_token_ids"] == prompt and "ctx_usage" in gen_leg["disaggregated_params"]


async def test_trtllm_two_legs_serve_completions_with_the_context_token_ids(pool: Pool):
    body = {"model": "mock-model", "prompt": "a completions prompt " * 20, "max_tokens": 3}
    st, doc, _ = await send(pool.trt.url, body, {HEADER: pool.ctx.address}, path="/v1/completions")
    gen_leg = json.loads(_raw(pool.gen, "/mock/last-request"))
    assert st == 200 and doc["object"] == "text_completion" and doc["usage"]["completion_tokens"] == 3
    assert gen_leg["disaggregated_params"]["request_type"] == "generation_only"
    assert isinstance(gen_leg["prompt"], list) and len(gen_leg["prompt"]) == doc["usage"]["prompt_tokens"]


async def test_trtllm_usage_covers_both_legs(pool: Pool):
    prompt = ids(100, 20_000)
    st, doc, _ = await send(pool.trt.url, chat(prompt, max_tokens=6), {HEADER: pool.ctx.address})
    assert st == 200
    assert doc["usage"]["prompt_tokens"] == 100 and doc["usage"]["completion_tokens"] == 6
    assert doc["usage"]["total_tokens"] == 106


async def test_trtllm_cached_tokens_are_the_prefill_workers_hits(pool: Pool):
    prompt = ids(100, 30_000)
    _, first, _ = await send(pool.trt.url, chat(prompt), {HEADER: pool.ctx.address})
    _, second, _ = await send(pool.trt.url, chat(prompt), {HEADER: pool.ctx.address})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 3 blocks, last token recomputed


async def test_trtllm_decode_worker_stores_and_publishes_the_transferred_blocks(pool: Pool):
    prompt = ids(100, 1_000)
    before = pool.gen.get("/mock/stats")
    st, _, _ = await send(pool.trt.url, chat(prompt), {HEADER: pool.ctx.address})
    cache, after = pool.gen.get("/mock/cache"), pool.gen.get("/mock/stats")
    held = {tuple(b["token_ids"]) for b in cache["blocks"]}
    assert st == 200 and all(tuple(prompt[i * 32:(i + 1) * 32]) in held for i in range(3))
    assert after["kv_events"]["batches_published"] > before["kv_events"]["batches_published"]
    # the decode engine found the transferred prefix: it recomputed only the 4-token tail
    assert after["cached_tokens_total"] - before["cached_tokens_total"] == 96


async def test_trtllm_two_legs_stream_to_a_streaming_client(pool: Pool):
    prompt = ids(100, 2_000)
    body = chat(prompt, max_tokens=5, stream=True, stream_options={"include_usage": True})
    st, _, text = await send(pool.trt.url, body, {HEADER: pool.ctx.address})
    docs = sse_docs(text)
    content = "".join(d["choices"][0]["delta"].get("content", "") for d in docs if d["choices"])
    assert st == 200 and text.endswith("data: [DONE]\n\n") and content
    assert docs[-1]["usage"]["completion_tokens"] == 5


async def test_trtllm_a_final_context_answer_is_the_answer_even_for_a_streaming_client(pool: Pool):
    prompt = ids(100, 3_000)
    first = output_token_ids(prompt, 1)[0]
    before = pool.gen.get("/mock/stats")["inference_requests"]
    st, _, text = await send(pool.trt.url, chat(prompt, stop_token_ids=[first], stream=True,
                                                stream_options={"include_usage": True}),
                             {HEADER: pool.ctx.address})
    docs = sse_docs(text)
    assert st == 200 and docs[1]["choices"][0]["finish_reason"] == "stop" and text.endswith("data: [DONE]\n\n")
    assert "disaggregated_params" not in text and docs[-1]["usage"]["completion_tokens"] == 1
    assert pool.gen.get("/mock/stats")["inference_requests"] == before


async def test_trtllm_image_requests_stay_decode_local(pool: Pool):
    before = pool.ctx.get("/mock/stats")["inference_requests"]
    body = {"model": "mock-model", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}
    await send(pool.trt.url, body, {HEADER: pool.ctx.address})
    assert pool.ctx.get("/mock/stats")["inference_requests"] == before
    assert json.loads(_raw(pool.gen, "/mock/last-request")) == body


async def test_a_comma_separated_header_uses_its_first_entry(pool: Pool):
    before = pool.ctx.get("/mock/stats")["inference_requests"]
    st, _, _ = await send(pool.trt.url, chat(ids(70, 4_000)), {HEADER: f"{pool.ctx.address}, 10.9.9.9:1"})
    assert st == 200 and pool.ctx.get("/mock/stats")["inference_requests"] == before + 1


# ------------------------------------------------------------------------------------------------ refusals
async def test_a_header_that_is_not_an_ip_port_literal_is_a_502(pool: Pool):
    before = pool.gen.get("/mock/stats")["inference_requests"]
    st, doc, _ = await send(pool.trt.url, chat(ids(10, 1)), {HEADER: "evil.example.com:80"})
    assert st == 502 and doc["error"]["code"] == "bad_header" and HEADER in doc["error"]["message"]
    assert pool.gen.get("/mock/stats")["inference_requests"] == before


async def test_a_prefiller_outside_the_allowed_list_is_a_403(pool: Pool):
    st, doc, _ = await send(pool.trt.url, chat(ids(10, 1)), {HEADER: "127.0.0.1:9"})
    assert st == 403 and doc["error"]["code"] == "not_allowed"


async def test_a_body_over_the_bound_is_refused(pool: Pool):
    st, _, _ = await send(pool.trt.url, chat(ids(10, 1), pad="x" * (2 << 20)), {HEADER: pool.ctx.address})
    assert st == 413


# ------------------------------------------------------------------------------------------------ failures
async def test_a_503_prefiller_is_retried_once_then_the_decode_worker_prefills(pool: Pool):
    hits = len(pool.fail503.seen)
    fallbacks = metric(pool.trt, "pd_sidecar_prefill_fallbacks_total")
    st, doc, _ = await send(pool.trt.url, chat(ids(40, 5_000)), {HEADER: pool.fail503.address})
    assert st == 200 and doc["usage"]["completion_tokens"] == 4
    assert len(pool.fail503.seen) - hits == 2
    assert metric(pool.trt, "pd_sidecar_prefill_fallbacks_total") == fallbacks + 1
    assert "disaggregated_params" not in json.loads(_raw(pool.gen, "/mock/last-request"))


async def test_a_500_prefiller_is_not_retried(pool: Pool):
    hits = len(pool.fail500.seen)
    st, _, _ = await send(pool.trt.url, chat(ids(40, 6_000)), {HEADER: pool.fail500.address})
    assert st == 200 and len(pool.fail500.seen) - hits == 1


async def test_an_unreachable_prefiller_falls_back_to_local_prefill(pool: Pool):
    st, doc, _ = await send(pool.trt.url, chat(ids(40, 8_000)), {HEADER: pool.dead})
    assert st == 200 and metric(pool.trt, "pd_sidecar_prefill_fallbacks_total", reason="unreachable") >= 1


async def test_a_client_that_leaves_during_the_prefill_leg_cancels_it(pool: Pool):
    cancelled = pool.hang.cancelled
    with pytest.raises(asyncio.TimeoutError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
            await s.post(pool.trt.url + "/v1/chat/completions", json=chat(ids(10, 1)),
                         headers={HEADER: pool.hang.address})
    for _ in range(100):
        if pool.hang.cancelled > cancelled:
            break
        await asyncio.sleep(0.05)
    assert pool.hang.cancelled == cancelled + 1
    assert metric(pool.trt, "pd_sidecar_legs_total", leg="prefill", outcome="cancelled") >= 1


# ----------------------------------------------------------------------------------------------------- vLLM
async def test_vllm_two_legs_follow_the_nixl_connector_flow(pool: Pool):
    body = chat(ids(40, 1), max_tokens=7, max_completion_tokens=7, stream=True,
                stream_options={"include_usage": True})
    st, _, text = await send(pool.vllm.url, body, {HEADER: pool.vllm_p.address})
    (pre, pre_h), (dec, dec_h) = pool.vllm_p.seen[-1], pool.vllm_d.seen[-1]
    assert st == 200 and text.endswith("data: [DONE]\n\n")
    assert pre["kv_transfer_params"]["do_remote_decode"] is True and pre["stream"] is False
    assert pre["max_tokens"] == 1 == pre["max_completion_tokens"] and "stream_options" not in pre
    assert dec["kv_transfer_params"] == VLLM_KV_TRANSFER_PARAMS and dec["max_tokens"] == 7 and dec["stream"]
    assert dec["stream_options"] == {"include_usage": True}
    assert pre_h["x-request-id"] == dec_h["x-request-id"] and HEADER not in dec_h


async def test_vllm_cached_tokens_are_rewritten_to_the_prefill_workers(pool: Pool):
    st, _, text = await send(pool.vllm.url, chat(ids(40, 1), stream=True, stream_options={"include_usage": True}),
                             {HEADER: pool.vllm_p.address})
    st2, doc, _ = await send(pool.vllm.url, chat(ids(40, 1)), {HEADER: pool.vllm_p.address})
    assert sse_docs(text)[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFILL_CACHED
    assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFILL_CACHED


async def test_a_client_that_leaves_during_the_decode_stream_cancels_it(pool: Pool):
    pool.vllm_d.slow = 0.5
    cancelled = pool.vllm_d.cancelled
    try:
        async with aiohttp.ClientSession() as s:
            r = await s.post(pool.vllm.url + "/v1/chat/completions", json=chat(ids(40, 1), stream=True),
                             headers={HEADER: pool.vllm_p.address})
            await r.content.readline()
            r.close()
        for _ in range(100):
            if pool.vllm_d.cancelled > cancelled:
                break
            await asyncio.sleep(0.05)
    finally:
        pool.vllm_d.slow = 0.0
    assert pool.vllm_d.cancelled == cancelled + 1
    assert metric(pool.vllm, "pd_sidecar_legs_total", leg="decode", outcome="cancelled") >= 1
