"""Integration: the subscribers against ZeroMQ's per-context socket limit (real libzmq, real PUB sockets).

A picker with in-process ingest opens three sockets per worker (SUB, its monitor, the monitor's peer): with
libzmq's default of 1,023 per context a 1,000-worker pool used to fail with "Too many open files" inside a
task nobody awaited. The limit is now raised as far as RLIMIT_NOFILE allows, and a worker refused a socket
anyway is counted, reported and retried instead of raising.
"""

from __future__ import annotations

import logging
import resource

import pytest
import zmq
import zmq.asyncio

import kvindex.subscriber as subscriber_module
from epp_extproc.dev.kvwire import stored_event
from kvindex.index import KvIndex
from kvindex.subscriber import DEFAULT_ZMQ_MAX_SOCKETS, SubscriberManager, raise_socket_limit, socket_budget
from tests.integration.test_kvindex_subscriber import BS, FakeWorker, toks
from tests.netutil import free_port
from tests.waiting import until_async


@pytest.fixture
async def small_ctx():
    """A context with room for one worker's subscription (3 sockets) and one more socket."""
    c = zmq.asyncio.Context()
    c.set(zmq.MAX_SOCKETS, 4)  # before its first socket: libzmq sizes its table then
    yield c
    c.destroy(linger=0)


async def test_a_worker_refused_a_socket_does_not_raise_and_is_reported(small_ctx, ctx):
    mgr = SubscriberManager(KvIndex(default_block_size=BS), zmq_context=small_ctx)
    try:
        await mgr.add("a", f"tcp://127.0.0.1:{free_port()}")
        await mgr.add("b", f"tcp://127.0.0.1:{free_port()}")  # raised ZMQError("Too many open files") before
        assert mgr.workers() == ["a"]
        assert "Too many open files" in mgr.refused()["b"]
        snap = mgr.stats_snapshot()
        assert snap["b"]["unsubscribed"] == 1 and snap["a"]["unsubscribed"] == 0
        assert mgr.refused_total == 1
    finally:
        await mgr.close()


async def test_the_refusal_is_logged_once_for_many_workers(small_ctx, caplog):
    mgr = SubscriberManager(KvIndex(default_block_size=BS), zmq_context=small_ctx)
    try:
        with caplog.at_level(logging.ERROR, logger="kvindex.subscriber"):
            for w in ("a", "b", "c", "d"):
                await mgr.add(w, f"tcp://127.0.0.1:{free_port()}")
        assert mgr.refused_total == 3
        assert sum("not subscribed" in r.getMessage() for r in caplog.records) == 1
    finally:
        await mgr.close()


async def test_a_refused_worker_is_subscribed_and_indexed_once_a_socket_frees(small_ctx, ctx, monkeypatch):
    monkeypatch.setattr(subscriber_module, "REFUSED_RETRY_S", 0.05)
    idx = KvIndex(default_block_size=BS)
    mgr = SubscriberManager(idx, heartbeat_stale_s=0.2, zmq_context=small_ctx)
    pub = FakeWorker(ctx)
    try:
        await mgr.add("a", f"tcp://127.0.0.1:{free_port()}")
        await mgr.add("b", pub.endpoint)
        assert "b" in mgr.refused()
        await mgr.remove("a")
        await until_async(lambda: mgr.workers() == ["b"])
        assert mgr.refused() == {}
        await pub.sync(mgr, "b")
        await pub.publish([stored_event([1], None, toks(1), BS)])
        await until_async(lambda: idx.overlap(toks(1) + [0], workers=["b"]) == {"b": 1})
    finally:
        await mgr.close()
        pub.close()


def test_the_socket_budget_follows_the_descriptor_limit():
    assert socket_budget(20_000) == 10_000
    assert socket_budget(1024) == DEFAULT_ZMQ_MAX_SOCKETS  # never below libzmq's own default


def test_a_fresh_context_gets_the_budget_as_its_socket_limit():
    c = zmq.Context()
    try:
        assert raise_socket_limit(c, 20_000) == 10_000
        assert c.get(zmq.MAX_SOCKETS) == 10_000
    finally:
        c.term()


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 4096, reason="needs ulimit -n >= 4096")
async def test_a_picker_of_its_own_context_subscribes_more_workers_than_libzmqs_default_allows():
    mgr = SubscriberManager(KvIndex(default_block_size=BS))  # its own context, as KvRouting makes it
    try:
        for i in range(400):  # 1,200 sockets: past the 1,023 default
            await mgr.add(f"w{i}", f"tcp://127.0.0.1:{20_000 + i}")
        assert len(mgr.workers()) == 400 and mgr.refused() == {}
    finally:
        await mgr.close()
