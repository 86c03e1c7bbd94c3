"""Integration: a whole picker with `--kv-ingest apart`: it starts its own ingest process, waits for the index to
be warm before it is ready, and serves `/debug/kv` from the ingest; a real ZeroMQ publisher feeds it."""

from __future__ import annotations

import asyncio

import aiohttp
import zmq
import zmq.asyncio

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from tests.integration.test_ingest_apart import BS, Publisher, tokens
from tests.waiting import until_async


async def test_a_picker_with_ingest_apart_serves_the_ingests_index_and_stops_it() -> None:
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    await pub.store(tokens(3))  # before the picker exists: its ingest warms it up from the replay
    app = PickerApp(Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                           admin_bind="127.0.0.1", tokenizer_protocol="trtllm-render",
                           tokenizer_service_url="http://127.0.0.1:1", kv_cache_block_size=BS,
                           endpoints=f"w=127.0.0.1:8600;kv={pub.endpoint};replay={pub.replay}",
                           kv_ingest="apart", endpoint_probe_interval_ms=0))
    try:
        await app.start()
        assert app.ingest is not None
        await until_async(app.ready, "the picker to be ready (index warm)", timeout=20)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{app.admin_port}/debug/kv") as r:
                snap = await r.json()
        assert snap["workers"]["127.0.0.1:8600"]["blocks_indexed"] == 3
        assert snap["ingest"][0]["pid"] == app.ingest.pids()[0]
    finally:
        await app.stop(0.1)
        pub.close()
        ctx.destroy(linger=0)
    assert app.ingest.alive() == [False]


async def test_the_shards_per_worker_counters_are_exported_as_the_pickers_kv_metrics(monkeypatch) -> None:
    import epp_extproc.adapters.kv_remote as kv_remote

    monkeypatch.setattr(kv_remote, "METRICS_REFRESH_S", 0.1)
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    await pub.store(tokens(3))
    app = PickerApp(Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                           admin_bind="127.0.0.1", tokenizer_protocol="trtllm-render",
                           tokenizer_service_url="http://127.0.0.1:1", kv_cache_block_size=BS,
                           endpoints=f"w=127.0.0.1:8601;kv={pub.endpoint};replay={pub.replay}",
                           kv_ingest="apart", endpoint_probe_interval_ms=0))
    try:
        await app.start()

        async def blocks() -> str:
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{app.metrics_port}/metrics") as r:
                return await r.text()
        text = ""
        for _ in range(100):
            text = await blocks()
            if 'epp_kv_blocks_stored_total{worker="127.0.0.1:8601"} 3.0' in text:
                break
            await asyncio.sleep(0.1)
        assert 'epp_kv_blocks_stored_total{worker="127.0.0.1:8601"} 3.0' in text
        assert 'epp_kv_replays_total{worker="127.0.0.1:8601"}' in text  # a subscriber counter, too
    finally:
        await app.stop(0.1)
        pub.close()
        ctx.destroy(linger=0)
