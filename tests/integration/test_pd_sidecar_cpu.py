"""The sidecar's own CPU per request, measured (process CPU time from /proc) over N requests through it, on
each path, beside the decode worker's CPU for the same requests sent to it directly (the baseline of the same
run). Prints the figures docs/pd-sidecar.md reports; asserts only ratios to the baseline."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import aiohttp
import pytest

from epp_extproc.dev import procs
from tests.integration.test_pd_sidecar import HEADER, sidecar_proc
from tests.stack import MockProc

pytestmark = pytest.mark.slow  # over 15 s: `make test-slow`
N = 150


async def _drive(url: str, n: int, headers: dict[str, str], stream: bool, start: int) -> None:
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            body = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                    "prompt_token_ids": list(range(start + i * 7, start + i * 7 + 300)), "stream": stream}
            async with s.post(url + "/v1/chat/completions", data=json.dumps(body),
                              headers={"content-type": "application/json", **headers}) as r:
                assert r.status == 200, await r.text()
                await r.read()


def test_sidecar_cpu_per_request_is_reported_and_below_the_decode_workers_own():
    logdir = Path(tempfile.mkdtemp(prefix="pd-cpu-"))
    ctx = MockProc.of(procs.mock_worker("ctx", logdir, heartbeat_s=None))
    gen = MockProc.of(procs.mock_worker("gen", logdir, heartbeat_s=None))
    sc = sidecar_proc("sidecar", logdir, gen.url, "trtllm", [ctx.address], ("--log-level", "WARNING"))
    started = []
    try:
        for p in (ctx, gen, sc):
            started.append(p.start())
        asyncio.run(_drive(sc.url, 10, {}, False, 100))  # warm-up
        rows = {}
        for name, url, hdrs, stream, start in (
                ("direct (no sidecar)", gen.url, {}, False, 1000),
                ("sidecar, no header", sc.url, {}, False, 2000),
                ("sidecar, no header, stream", sc.url, {}, True, 3000),
                ("sidecar, TensorRT-LLM two legs", sc.url, {HEADER: ctx.address}, False, 4000),
                ("sidecar, TensorRT-LLM two legs, stream", sc.url, {HEADER: ctx.address}, True, 5000)):
            s0, g0 = sc.cpu_seconds(), gen.cpu_seconds()
            asyncio.run(_drive(url, N, hdrs, stream, start))
            rows[name] = ((sc.cpu_seconds() - s0) / N * 1000, (gen.cpu_seconds() - g0) / N * 1000)
    finally:
        for p in started:
            p.stop()
    for name, (side, dec) in rows.items():
        print(f"{name:42s} sidecar {side:6.3f} ms CPU/request, decode worker {dec:6.3f} ms CPU/request")
    base = rows["direct (no sidecar)"][1]
    assert rows["sidecar, no header"][0] < 2 * base
    assert rows["sidecar, TensorRT-LLM two legs"][0] < 4 * base
