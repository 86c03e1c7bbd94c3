"""`epp-kv-relay` as its own process in front of trtllm_mock (real engine-dialect events, no engine replay), a
real nats-server, and pickers' plane subscribers in this process: a picker restarted mid-run comes back with
the worker's whole cache from the relay's dump, where on ZeroMQ alone it would start empty."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from epp_extproc.dev.nats import NatsServer
from epp_extproc.kvplane.follower import PlaneSubscribers
from epp_extproc.kvplane.wire import Subjects
from kvindex.index import KvIndex
from kvindex.subscriber import KvSource, SubscriberManager
from tests.integration.test_kvindex_subscriber import chat, index_matches, prompts
from tests.mock.test_mock_support import running_worker
from tests.natsutil import nats_server  # noqa: F401  (fixture)
from tests.waiting import until_async

BS = 4


async def start_relay(server: NatsServer, address: str, kv: str) -> AsyncIterator[asyncio.subprocess.Process]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp_extproc.kvplane.relay", "--nats-url", server.url, "--pool", "p",
        "--endpoints", f"{address};kv={kv}", "--kv-cache-block-size", str(BS), "--heartbeat-s", "0.2",
        "--log-level", "WARNING", env=env)
    return proc


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


def plane(server: NatsServer, idx: KvIndex) -> PlaneSubscribers:
    return PlaneSubscribers(idx, SubscriberManager(idx), [server.url], Subjects(pool="p"), dump_timeout_s=2.0)


@pytest.mark.parametrize("dialect", ["trtllm", "vllm", "sglang"])
async def test_a_restarted_picker_recovers_the_whole_cache_from_the_relay_without_engine_replay(nats_server,  # noqa: F811
                                                                                                 dialect):
    async with running_worker(tokens_per_block=BS, event_dialect=dialect, heartbeat_interval=0.1) as m, \
            aiohttp.ClientSession() as s:
        assert m.replay_endpoint is None
        address = m.url.removeprefix("http://")
        relay = await start_relay(nats_server, address, m.kv_events_endpoint)
        try:
            first = KvIndex(BS)
            picker = plane(nats_server, first)
            await picker.add(address, [KvSource(m.kv_events_endpoint)])
            await until_async(lambda: picker.stats(address).mode == "live", "the first picker on the plane",
                              timeout=20)
            for p in prompts(20):
                await chat(s, m, p)
            await index_matches(first, s, m, wid=address)
            await picker.close()  # the picker restarts; the engine goes on storing meanwhile
            for p in prompts(30)[20:]:
                await chat(s, m, p)
            second = KvIndex(BS)
            again = plane(nats_server, second)
            await again.add(address, [KvSource(m.kv_events_endpoint)])
            await index_matches(second, s, m, wid=address, timeout=20)
            assert again.stats(address).dumps >= 1 and len(second.engine_hashes(address)) >= 30
            await again.close()
        finally:
            await stop(relay)
