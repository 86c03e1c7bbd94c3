"""Integration: real ZeroMQ publishers, a real ingest process (`python -m epp_extproc.ingest`), real Unix sockets.

The in-process index (`KvRouting`) fed by the same publishers is the reference: the remote lookup must answer
exactly what it answers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time

import pytest
import zmq
import zmq.asyncio

from epp_extproc.adapters.kv_remote import RemoteKv
from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.core.contract import PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.dev.kvwire import pack_batch, removed_event, stored_event
from epp_extproc.ingest.launcher import IngestGroup, shard_argv
from kvindex.decode import encode_seq
from kvindex.hashing import block_hashes
from tests.netutil import free_port
from tests.waiting import until_async

BS = 4


class Publisher:
    """A worker's KV-event PUB plus a replay ROUTER that answers from everything it published."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = free_port()
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        rport = free_port()
        self.router.bind(f"tcp://127.0.0.1:{rport}")
        self.replay = f"tcp://127.0.0.1:{rport}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.engine_hash = 1000
        self.last: int | None = None  # the engine hash of the chain's tail, to extend it
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, _, start8 = await self.router.recv_multipart()
            start = int.from_bytes(start8, "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    await self.router.send_multipart([ident, b"", encode_seq(seq), payload])
            await self.router.send_multipart([ident, b"", b"\xff" * 8, b""])

    async def publish(self, events: list) -> None:
        self.seq += 1
        payload = pack_batch(events)
        self.buffer.append((self.seq, payload))
        await self.pub.send_multipart([b"", encode_seq(self.seq), payload])

    async def store(self, tokens: list[int], parent: int | None = None) -> list[int]:
        """Store a chain of whole blocks; its engine hashes."""
        n = len(tokens) // BS
        hashes = list(range(self.engine_hash, self.engine_hash + n))
        self.engine_hash += n
        await self.publish([stored_event(hashes, parent, tokens[: n * BS], BS)])
        return hashes

    def close(self) -> None:
        self._task.cancel()
        self.router.close(0)
        self.pub.close(0)


@pytest.fixture
def sock_dir():
    with tempfile.TemporaryDirectory(prefix="epp-ingest-") as d:
        yield d


@pytest.fixture(params=["thread", "loop"])
def ingest(sock_dir, request):
    """One shard, answering lookups on threads or on its loop between batches (`--lookups`)."""
    group = IngestGroup([shard_argv(sock_dir, 0, 1, block_size=BS, max_blocks_per_worker=10_000, topic="",
                                    worker_cpu_share=0.25, log_level="WARNING", lookups=request.param)])
    group.start()
    yield group
    group.stop()


def remote(registry: EndpointRegistry, sock_dir: str, client: str = "a", ttl: float = 0.0) -> RemoteKv:
    kv = RemoteKv(registry, directory=sock_dir, shards=1, block_size=BS, prediction_ttl_s=ttl,
                  lookup_timeout_s=0.5, client_id=client, ask_server_info=False)
    kv.start()
    return kv


def tokens(n_blocks: int, start: int = 1) -> list[int]:
    return list(range(start, start + n_blocks * BS))


async def until_warm(kv: RemoteKv, addresses: list[str], timeout: float = 15.0) -> None:
    await until_async(lambda: all(kv.warm(a) for a in addresses), timeout=timeout)


async def test_remote_overlap_answers_what_the_in_process_index_answers(ctx, sock_dir, ingest) -> None:
    pubs = [Publisher(ctx) for _ in range(3)]
    eps = [Endpoint(f"w{i}", f"127.0.0.1:{8000 + i}", p.endpoint, p.replay) for i, p in enumerate(pubs)]
    reg_local, reg_remote = EndpointRegistry(), EndpointRegistry()
    local = KvRouting(reg_local, block_size=BS, max_blocks_per_worker=10_000, topic="", prediction_ttl_s=0.0,
                      metrics_registry=None, ask_server_info=False)
    kv = remote(reg_remote, sock_dir)
    try:
        reg_local.replace(eps)
        reg_remote.replace(eps)
        await asyncio.sleep(0.5)  # both subscribed (the replay warm-up fills in anything sent before)
        chain = await pubs[0].store(tokens(8))
        await pubs[1].store(tokens(5))
        await pubs[2].store(tokens(3, start=500))
        await pubs[0].publish([removed_event([chain[-1]])])
        await pubs[0].store(tokens(2, start=900), parent=chain[5])
        addrs = [e.address for e in eps]
        await until_warm(kv, addrs)
        prompts = [tokens(8) + [7], tokens(12), tokens(3, start=500) + [1], tokens(6) + tokens(2, start=900) + [3]]

        def same() -> bool:
            return all(kv.overlap(kv.prompt(p, PromptIdentity()), addrs)
                       == local.overlap(local.prompt(p, PromptIdentity()), addrs) for p in prompts)
        await until_async(same, timeout=10)
        assert kv.overlap(kv.prompt(prompts[0], PromptIdentity()), addrs) == {addrs[0]: 7, addrs[1]: 5}
        assert kv.counts["ok"] > 0
    finally:
        await kv.close()
        await local.close()
        for p in pubs:
            p.close()


async def test_a_subset_of_candidates_gets_only_its_own_figures(ctx, sock_dir, ingest) -> None:
    pubs = [Publisher(ctx) for _ in range(2)]
    eps = [Endpoint(f"w{i}", f"127.0.0.1:{8100 + i}", p.endpoint, p.replay) for i, p in enumerate(pubs)]
    reg = EndpointRegistry()
    kv = remote(reg, sock_dir)
    try:
        reg.replace(eps)
        await asyncio.sleep(0.3)
        for p in pubs:
            await p.store(tokens(4))
        await until_warm(kv, [e.address for e in eps])
        prompt = kv.prompt(tokens(4) + [1], PromptIdentity())
        await until_async(lambda: len(kv.overlap(prompt, [e.address for e in eps])) == 2)
        assert kv.overlap(prompt, [eps[1].address]) == {eps[1].address: 4}
    finally:
        await kv.close()
        for p in pubs:
            p.close()


async def test_a_prediction_made_in_one_picker_process_is_seen_by_another(ctx, sock_dir, ingest) -> None:
    pub = Publisher(ctx)
    ep = Endpoint("w", "127.0.0.1:8200", pub.endpoint, pub.replay)
    reg_a, reg_b = EndpointRegistry(), EndpointRegistry()
    a = remote(reg_a, sock_dir, client="a", ttl=30.0)
    b = remote(reg_b, sock_dir, client="b", ttl=30.0)
    try:
        reg_a.replace([ep])
        reg_b.replace([ep])
        await pub.store(tokens(1))
        await until_warm(a, [ep.address])
        prompt = tokens(6) + [1]
        assert b.overlap(b.prompt(prompt, PromptIdentity()), [ep.address]).get(ep.address, 0) <= 1
        a.predict(ep.address, a.prompt(prompt, PromptIdentity()))
        await until_async(lambda: b.overlap(b.prompt(prompt, PromptIdentity()), [ep.address]) == {ep.address: 6})
    finally:
        await a.close()
        await b.close()
        pub.close()


async def test_a_crashed_ingest_is_restarted_and_rewarmed_while_lookups_answer_by_load(ctx, sock_dir, ingest) -> None:
    pub = Publisher(ctx)
    ep = Endpoint("w", "127.0.0.1:8300", pub.endpoint, pub.replay)
    reg = EndpointRegistry()
    kv = remote(reg, sock_dir)
    poller = asyncio.create_task(ingest.run())
    try:
        reg.replace([ep])
        await asyncio.sleep(0.3)
        await pub.store(tokens(5))
        prompt = kv.prompt(tokens(5) + [1], PromptIdentity())
        await until_async(lambda: kv.overlap(prompt, [ep.address]) == {ep.address: 5}, timeout=15)
        pid = ingest.pids()[0]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await until_async(lambda: not ingest.alive()[0])
        down = kv.counts["unavailable"]
        assert kv.overlap(prompt, [ep.address]) == {}  # answered at once, empty: the request routes by load
        assert kv.counts["unavailable"] > down
        # restarted by the group, re-warmed from the publisher's replay buffer, and answering again
        await until_async(lambda: kv.overlap(prompt, [ep.address]) == {ep.address: 5}, timeout=20)
        assert ingest.restarts == 1
    finally:
        poller.cancel()
        await kv.close()
        pub.close()


async def test_a_lookup_to_a_missing_ingest_returns_at_once(sock_dir) -> None:
    reg = EndpointRegistry()
    kv = RemoteKv(reg, directory=sock_dir, shards=2, block_size=BS, prediction_ttl_s=0.0,
                  lookup_timeout_s=5.0, ask_server_info=False)
    reg.replace([Endpoint("w", "127.0.0.1:8400", None)])
    t = time.monotonic()
    assert kv.overlap(kv.prompt(tokens(3), PromptIdentity()), ["127.0.0.1:8400"]) == {}
    assert time.monotonic() - t < 1.0  # nowhere near the 5 s deadline: nothing to wait for
    assert kv.counts["unavailable"] == 1
    await kv.close()


async def test_snapshot_shows_the_shards_workers(ctx, sock_dir, ingest) -> None:
    pub = Publisher(ctx)
    ep = Endpoint("w", "127.0.0.1:8500", pub.endpoint, pub.replay)
    reg = EndpointRegistry()
    kv = remote(reg, sock_dir)
    try:
        reg.replace([ep])
        await pub.store(tokens(3))
        await until_warm(kv, [ep.address])
        snap = await kv.snapshot()
        assert snap["workers"][ep.address]["blocks_indexed"] == 3
        assert snap["ingest"][0]["up"] is True
    finally:
        await kv.close()
        pub.close()


def test_chain_hashes_match_between_prompt_and_index() -> None:
    """The hashes the picker sends are the index's own chain (kvindex.hashing), block for block."""
    reg = EndpointRegistry()
    kv = RemoteKv(reg, directory="/nonexistent", shards=1, block_size=BS, prediction_ttl_s=0.0,
                  ask_server_info=False)
    p = kv.prompt(tokens(3) + [9], PromptIdentity())
    assert p.hashes(BS) == block_hashes(tokens(3), BS)
