"""Integration: one publisher floods the ingest (an ingest shard, or the picker's own loop with the default
`--kv-ingest inprocess`); another worker's events stay fresh, and the flooder is the one paused (its own
budget), through real ZeroMQ (and a real ingest process for the shard)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from epp_extproc.config import KvSection, ProcessSlot
from epp_extproc.core.contract import PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.dev.kvwire import stored_event
from epp_extproc.ingest.launcher import IngestGroup, shard_argv
from epp_extproc.ingest.setup import build_kv
from tests.integration.test_ingest_apart import BS, Publisher, remote, tokens, until_warm
from tests.waiting import until_async

FLOOD_BLOCKS = 64  # per event; 4 events per batch


async def flood(pub: Publisher, stop: asyncio.Event) -> int:
    n = 0
    while not stop.is_set():
        events = []
        for _ in range(4):
            start = 100_000 + n * FLOOD_BLOCKS * BS
            hashes = list(range(pub.engine_hash, pub.engine_hash + FLOOD_BLOCKS))
            pub.engine_hash += FLOOD_BLOCKS
            events.append(stored_event(hashes, None, list(range(start, start + FLOOD_BLOCKS * BS)), BS))
            n += 1
        await pub.publish(events)
        if n % 40 == 0:
            await asyncio.sleep(0)
    return n


async def flood_beside_quiet(kv: Any, flooder: Publisher, quiet: Publisher, eps: list[Endpoint],
                             stop: asyncio.Event) -> tuple[int, list[float]]:
    """Both warm, then `flooder` floods while `quiet` stores a fresh chain every 0.1 s, ten times: (batches the
    flooder sent, seconds until each of the quiet worker's chains was credited)."""
    await flooder.store(tokens(1))
    await quiet.store(tokens(1))
    await until_warm(kv, [e.address for e in eps])
    task = asyncio.create_task(flood(flooder, stop))
    freshness = []
    for i in range(10):
        await asyncio.sleep(0.1)
        toks = tokens(3, start=10_000 + i * 100)
        await quiet.store(toks)
        t = time.monotonic()
        prompt = kv.prompt(toks + [1], PromptIdentity())
        await until_async(lambda p=prompt: kv.overlap(p, [eps[1].address]) == {eps[1].address: 3},
                          timeout=10, interval=0.005)
        freshness.append(time.monotonic() - t)
    stop.set()
    return await task, freshness


def assert_only_the_flooder_paused(snap: dict[str, Any], eps: list[Endpoint], sent: int,
                                   freshness: list[float]) -> None:
    assert sent > 100
    assert snap["workers"][eps[0].address].get("ingest_throttled", 0) > 0, "the flooder was never paused"
    assert snap["workers"][eps[1].address].get("ingest_throttled", 0) == 0
    assert max(freshness) < 1.0, freshness  # generous for two shared cores: a stall would be seconds


async def test_a_flooding_publisher_is_paused_and_another_worker_stays_fresh() -> None:
    ctx = zmq.asyncio.Context()
    with tempfile.TemporaryDirectory(prefix="epp-ingest-") as d:
        group = IngestGroup([shard_argv(d, 0, 1, block_size=BS, max_blocks_per_worker=20_000, topic="",
                                        worker_cpu_share=0.05, log_level="WARNING")])
        group.start()
        flooder, quiet = Publisher(ctx), Publisher(ctx)
        eps = [Endpoint("flood", "127.0.0.1:8700", flooder.endpoint, flooder.replay),
               Endpoint("quiet", "127.0.0.1:8701", quiet.endpoint, quiet.replay)]
        reg = EndpointRegistry()
        kv = remote(reg, d)
        stop = asyncio.Event()
        try:
            reg.replace(eps)
            sent, freshness = await flood_beside_quiet(kv, flooder, quiet, eps, stop)
            assert_only_the_flooder_paused(await kv.snapshot(), eps, sent, freshness)
        finally:
            stop.set()
            await kv.close()
            flooder.close()
            quiet.close()
            group.stop()
            ctx.destroy(linger=0)


async def test_with_the_defaults_a_flooding_publisher_is_paused_in_the_pickers_own_loop() -> None:
    """The default in-process ingest (the KV view as the app builds it from a default KvSection) charges each
    worker's messages to its own CPU budget, as a shard does: the flooder waits, the quiet worker stays fresh,
    and the loop the decisions share keeps turning."""
    ctx = zmq.asyncio.Context()
    flooder, quiet = Publisher(ctx), Publisher(ctx)
    eps = [Endpoint("flood", "127.0.0.1:8700", flooder.endpoint, flooder.replay),
           Endpoint("quiet", "127.0.0.1:8701", quiet.endpoint, quiet.replay)]
    reg = EndpointRegistry()
    kv, group, _ = build_kv(KvSection(kv_cache_block_size=BS), ProcessSlot(), reg, CollectorRegistry())
    assert group is None  # in process: no shard
    stop = asyncio.Event()
    try:
        reg.replace(eps)
        sent, freshness = await flood_beside_quiet(kv, flooder, quiet, eps, stop)
        assert_only_the_flooder_paused(kv.snapshot(), eps, sent, freshness)
    finally:
        stop.set()
        await kv.close()
        flooder.close()
        quiet.close()
