"""Endpoint changes drive the KV side: a discovered worker gets a subscriber, a departed one loses its entries."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from bench.kvwire import pack_batch, stored_event
from epp_extproc.adapters.kv_routing import KvRouting, Prompt
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from kvindex.decode import encode_seq
from tests.netutil import free_port

TOKENS = list(range(1000, 1000 + 32 * 4 + 1))


async def publish_until_indexed(pub: zmq.asyncio.Socket, kv: KvRouting, address: str) -> None:
    """Publish one 4-block chain (again, with a fresh seq, until the slow-joining SUB has it)."""
    payload = pack_batch([stored_event([11, 12, 13, 14], None, TOKENS[:128], 32)])
    for seq in range(200):
        await pub.send_multipart([b"", encode_seq(seq), payload])
        await asyncio.sleep(0.02)
        if kv.overlap(Prompt(TOKENS, None), [address]).get(address) == 4:
            return
    raise AssertionError("the subscriber never indexed the published chain")


async def test_discovered_worker_is_subscribed_and_a_departed_one_is_dropped() -> None:
    port = free_port()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    registry = EndpointRegistry()
    kv = KvRouting(registry, block_size=32, max_blocks_per_worker=1000, topic="", prediction_ttl_s=0.0,
                   metrics_registry=None, ask_server_info=False)
    ep = Endpoint("w", "127.0.0.1:8000", f"tcp://127.0.0.1:{port}")
    try:
        registry.replace([ep])
        await publish_until_indexed(pub, kv, ep.address)
        assert kv.subscribers.workers() == [ep.address]
        registry.replace([])
        for _ in range(100):
            if not kv.subscribers.workers():
                break
            await asyncio.sleep(0.01)
        assert kv.subscribers.workers() == []
        assert kv.index.blocks_indexed(ep.address) == 0
        assert kv.overlap(Prompt(TOKENS, None), [ep.address]) == {}
    finally:
        await kv.close()
        pub.close(0)
        ctx.term()
