"""One set of worker facts for both KV views: what a worker says about itself is learned and kept once
(adapters/worker_facts.py), and the in-process and the ingest-apart views hash prompts by it alike."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from epp_extproc.adapters import worker_facts
from epp_extproc.adapters.kv_remote import RemoteKv
from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.core.contract import MediaItem, PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry

TOKENS = list(range(100))


W = "10.0.0.1:8000"


def views(ask_server_info: bool = False) -> tuple[EndpointRegistry, KvRouting, EndpointRegistry, RemoteKv]:
    inproc, apart = EndpointRegistry(), EndpointRegistry()
    return (inproc, KvRouting(inproc, block_size=16, max_blocks_per_worker=1000, topic="", prediction_ttl_s=60.0,
                              metrics_registry=None, ask_server_info=ask_server_info),
            apart, RemoteKv(apart, directory="/nonexistent", shards=2, block_size=16, prediction_ttl_s=60.0,
                            ask_server_info=ask_server_info))


def test_both_views_hash_a_request_naming_an_adapter_with_it_and_the_same_way() -> None:
    _, local, _, remote = views()
    for kv in (local, remote):
        kv.facts.set_adapters(W, {"sql-lora": "base"})
    ident = PromptIdentity(salt="t", model="sql-lora")
    a, b = local.prompt(TOKENS, ident), remote.prompt(TOKENS, ident)
    assert a.lora == b.lora == "sql-lora" and a.hashes(16) == b.hashes(16)
    assert local.base_model_for("sql-lora") == remote.base_model_for("sql-lora") == "base"
    assert local.prompt(TOKENS, PromptIdentity(model="base")).lora is None


def test_a_media_prompt_is_keyed_in_the_default_dialect_until_the_events_say_otherwise() -> None:
    _, local, _, remote = views()
    media = PromptIdentity(media=(MediaItem("img", 10, 20),))
    for kv in (local, remote):
        p = kv.prompt(TOKENS, media)
        assert kv.facts.dialect(W) == "vllm"
        assert kv.facts.hashes(p, W, 16) == p.hashes(16, "vllm")


async def test_a_reported_block_size_and_adapters_are_learned_once_and_leave_with_the_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def block_size(_address: str) -> int:
        return 8

    async def adapters(_address: str) -> dict[str, str]:
        return {"sql-lora": "base"}

    monkeypatch.setattr(worker_facts, "fetch_block_size", block_size)
    monkeypatch.setattr(worker_facts, "fetch_served_adapters", adapters)
    inproc, local, apart, remote = views(ask_server_info=True)
    heard: list[tuple[Any, ...]] = []
    try:
        for registry, kv in ((inproc, local), (apart, remote)):
            kv.facts.predict_listeners.append(lambda *a: heard.append(a))
            registry.replace([Endpoint("w", W)])
            for _ in range(100):
                await asyncio.sleep(0.01)
                if not len(kv._tasks) and kv.facts.adapter_for("sql-lora"):
                    break
            assert kv.facts.reported == {W: 8} and kv.block_size(W) == 8
            assert kv.facts.adapter_for("sql-lora", W) == "sql-lora"
            kv.predict(W, kv.prompt(TOKENS, PromptIdentity()))
            registry.replace([])
            await asyncio.sleep(0.05)
            assert kv.facts.reported == {} and kv.facts.adapter_for("sql-lora") is None
        # each view told the listeners (replica sync) of its prediction in the size the worker reported
        assert [(a, size, len(h)) for a, size, h, _ in heard] == [(W, 8, 12), (W, 8, 12)]
    finally:
        await local.close()
        await remote.close()


async def test_a_large_pool_joining_at_once_is_asked_about_itself_a_few_workers_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """10,000 workers given at start-up were all asked at once: ~40,000 connections, the process at its
    descriptor limit (bench_tenk)."""
    now = peak = asked = 0

    async def block_size(_address: str) -> None:
        nonlocal now, peak, asked
        now += 1
        asked += 1
        peak = max(peak, now)
        await asyncio.sleep(0.001)
        now -= 1

    async def adapters(_address: str) -> None:
        return None

    monkeypatch.setattr(worker_facts, "fetch_block_size", block_size)
    monkeypatch.setattr(worker_facts, "fetch_served_adapters", adapters)
    n = 4 * worker_facts.MAX_LEARNING
    for registry, kv in views(ask_server_info=True)[0:2], views(ask_server_info=True)[2:4]:
        try:
            now = peak = asked = 0
            registry.replace([Endpoint(f"w{i}", f"10.0.{i // 200}.{1 + i % 200}:8000") for i in range(n)])
            for _ in range(500):
                await asyncio.sleep(0.01)
                if asked == n and not len(kv._tasks):
                    break
            assert asked == n and peak == worker_facts.MAX_LEARNING
        finally:
            await kv.close()


async def test_the_listeners_hear_only_the_blocks_a_prediction_credited_not_those_the_worker_holds() -> None:
    """Replica sync sends a prediction to every peer, whose index holds the same stored blocks: the held
    part of a prompt (~60% on the trace) was sent and re-checked there for nothing."""
    from epp_extproc.dev.kvwire import pack_batch, stored_event
    from kvindex.decode import decode_payload

    _, local, _, _ = views()
    heard: list[tuple[Any, ...]] = []
    local.facts.predict_listeners.append(lambda *a: heard.append(a))
    try:
        local.index.apply_batch(W, decode_payload(pack_batch([stored_event([1, 2], None, TOKENS[:32], 16)])))
        prompt = local.prompt(TOKENS, PromptIdentity())
        local.predict(W, prompt)
        assert [list(h) for _, _, h, _ in heard] == [prompt.hashes(16)[2:]]
        local.predict(W, local.prompt(TOKENS[:33], PromptIdentity()))  # held whole: nothing to tell
        assert len(heard) == 1
    finally:
        await local.close()
