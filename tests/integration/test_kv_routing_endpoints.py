"""Endpoint changes drive the KV side: a discovered worker gets a subscriber, a departed one loses its entries."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.adapters.server_info import fetch_block_size
from epp_extproc.adapters.worker_facts import Prompt
from epp_extproc.core.contract import PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.dev.kvwire import pack_batch, stored_event
from kvindex.decode import encode_seq
from tests.netutil import free_base_port, free_port

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


# ---------------------------------------------------------------------------------------------------------------
# Real engines (issue 12): data-parallel ranks, vLLM's /server_info 404, LoRA adapters from /v1/models.

async def test_an_endpoint_with_kv_ranks_keeps_one_subscription_per_rank_and_scores_the_best_rank() -> None:
    base = free_base_port((0, 1))  # rank r binds base + r
    ctx = zmq.asyncio.Context()
    pubs = [ctx.socket(zmq.PUB) for _ in range(2)]
    for r, p in enumerate(pubs):
        p.bind(f"tcp://127.0.0.1:{base + r}")
    registry = EndpointRegistry()
    kv = KvRouting(registry, block_size=32, max_blocks_per_worker=1000, topic="", prediction_ttl_s=0.0,
                   metrics_registry=None, ask_server_info=False)
    ep = Endpoint("w", "127.0.0.1:8000", f"tcp://127.0.0.1:{base}", kv_ranks=2)
    try:
        registry.replace([ep])
        rank0 = pack_batch([stored_event([11, 12], None, TOKENS[:64], 32)], rank=0)
        rank1 = pack_batch([stored_event([21, 22, 23, 24], None, TOKENS[:128], 32)], rank=1)
        for seq in range(200):  # each rank numbers its own batches
            await pubs[0].send_multipart([b"", encode_seq(seq), rank0])
            await pubs[1].send_multipart([b"", encode_seq(seq), rank1])
            await asyncio.sleep(0.02)
            if kv.index.engine_hashes(ep.address) == {11, 12, 21, 22, 23, 24}:
                break
        assert kv.index.engine_hashes(ep.address, 0) == {11, 12}
        assert kv.index.engine_hashes(ep.address, 1) == {21, 22, 23, 24}
        assert kv.overlap(Prompt(TOKENS, None), [ep.address]) == {ep.address: 4}  # the best rank
        snap = kv.snapshot()["workers"][ep.address]
        assert [e["rank"] for e in snap["kv_endpoints"]] == [0, 1] and snap["messages"] >= 2
    finally:
        await kv.close()
        for p in pubs:
            p.close(0)
        ctx.term()


def test_kv_ranks_offsets_both_ports_like_the_engines() -> None:
    ep = Endpoint("w", "10.0.0.5:8000", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600", kv_ranks=3)
    assert ep.kv_endpoints == ((0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600"),
                               (1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5601"),
                               (2, "tcp://10.0.0.5:5559", "tcp://10.0.0.5:5602"))
    assert Endpoint("w", "10.0.0.5:8000", "tcp://10.0.0.5:5557").kv_endpoints == ((None, "tcp://10.0.0.5:5557",
                                                                                  None),)


def test_kv_ranks_are_read_from_the_flag_the_file_and_pod_annotations() -> None:
    from epp_extproc.adapters.discovery_k8s import pod_endpoints
    from epp_extproc.adapters.discovery_static import EndpointSpecError, parse_document, parse_flag

    (a,) = parse_flag("w=10.0.0.5:8000;kv=tcp://10.0.0.5:5557;kv_ranks=2", kv_event_port=None, replay_port=None)
    (b,) = parse_document({"endpoints": [{"address": "10.0.0.6:8000", "kv_events": "tcp://10.0.0.6:5557",
                                          "kv_ranks": 4}]}, kv_event_port=None, replay_port=None)
    pod = {"metadata": {"name": "p", "annotations": {"epp-extproc/kv-ranks": "8"}},
           "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}}
    (c,) = pod_endpoints(pod, (8000,), 5557, None)
    assert (a.kv_ranks, b.kv_ranks, c.kv_ranks) == (2, 4, 8)
    with pytest.raises(EndpointSpecError):
        parse_flag("10.0.0.5:8000;kv_ranks=100000", kv_event_port=5557, replay_port=None)


async def _http(routes: dict[str, tuple[int, str]]) -> tuple[web.AppRunner, str]:
    app = web.Application()

    def handler(status: int, body: str):  # noqa: ANN202 - an aiohttp handler factory
        async def answer(_r: web.Request) -> web.Response:
            return web.Response(status=status, text=body)
        return answer

    for path, (status, body) in routes.items():
        app.router.add_get(path, handler(status, body))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"127.0.0.1:{port}"


VLLM_METRICS = (
    '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
    '# TYPE vllm:cache_config_info gauge\n'
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True"} 1.0\n'
)


async def test_vllm_block_size_is_learned_from_metrics_when_server_info_is_a_404(caplog) -> None:
    runner, address = await _http({"/metrics": (200, VLLM_METRICS)})  # /server_info: 404, as on vLLM
    try:
        with caplog.at_level(logging.WARNING):
            assert await fetch_block_size(address) == 16
        assert caplog.text == ""
    finally:
        await runner.cleanup()


async def test_a_worker_that_says_nothing_about_its_block_size_is_not_a_warning(caplog) -> None:
    runner, address = await _http({})
    registry = EndpointRegistry()
    kv = KvRouting(registry, block_size=32, max_blocks_per_worker=1000, topic="", prediction_ttl_s=0.0,
                   metrics_registry=None)
    try:
        with caplog.at_level(logging.WARNING):
            registry.replace([Endpoint("w", address, f"tcp://127.0.0.1:{free_port()}")])
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not len(kv._tasks):
                    break
        assert "WARNING" not in caplog.text and kv.block_size(address) == 32
    finally:
        await kv.close()
        await runner.cleanup()


async def test_lora_adapters_a_worker_serves_are_learned_and_a_request_naming_one_hashes_with_it() -> None:
    models = ('{"object": "list", "data": [{"id": "base", "object": "model", "parent": null},'
              ' {"id": "sql-lora", "object": "model", "parent": "base"}]}')
    runner, address = await _http({"/v1/models": (200, models), "/metrics": (200, VLLM_METRICS)})
    registry = EndpointRegistry()
    kv = KvRouting(registry, block_size=16, max_blocks_per_worker=1000, topic="", prediction_ttl_s=60.0,
                   metrics_registry=None)
    try:
        registry.replace([Endpoint("w", address, f"tcp://127.0.0.1:{free_port()}")])
        for _ in range(100):
            await asyncio.sleep(0.02)
            if kv.facts.adapter_for("sql-lora"):
                break
        assert kv.facts.adapter_for("sql-lora") == "sql-lora" and kv.facts.adapter_for("base") is None
        assert kv.facts.adapter_for("sql-lora", address) == "sql-lora"
        assert kv.base_model_for("sql-lora") == "base" and kv.base_model_for("base") is None  # render under it
        kv.predict(address, Prompt(TOKENS, None, lora="sql-lora"))
        assert kv.overlap(Prompt(TOKENS, None, lora="sql-lora"), [address]) == {address: 8}
        assert kv.overlap(Prompt(TOKENS, None), [address]) == {}
    finally:
        await kv.close()
        await runner.cleanup()


def test_the_prompt_of_a_request_naming_an_adapter_is_hashed_with_it() -> None:
    kv = KvRouting(EndpointRegistry(), block_size=32, max_blocks_per_worker=1000, topic="", prediction_ttl_s=0.0,
                   metrics_registry=None, ask_server_info=False)
    kv.facts.set_adapters("10.0.0.5:8000", ["sql-lora"])
    assert kv.prompt(TOKENS, PromptIdentity(model="sql-lora")).lora == "sql-lora"
    assert kv.prompt(TOKENS, PromptIdentity(model="base")).lora is None and kv.prompt(TOKENS).lora is None
