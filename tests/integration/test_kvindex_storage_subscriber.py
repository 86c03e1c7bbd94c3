"""Integration (issue 44): a real ZeroMQ PUB playing llm-d's file-system connector (its topic, its 8-byte seq,
its pre-packed batches) beside a worker's GPU event PUB, both read by the real subscribers into one index."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
import zmq
import zmq.asyncio

from epp_extproc.dev.kvwire import (
    pack_storage_batch,
    removed_event,
    storage_removed_event,
    storage_stored_event,
    stored_event,
)
from kvindex.hashing import block_hashes
from kvindex.index import KvIndex
from kvindex.subscriber import KvSource, SubscriberManager
from kvindex.tiers import TIER_BIT
from tests.integration.test_kvindex_subscriber import FakeWorker
from tests.netutil import free_port
from tests.waiting import until_async

BS = 4
GPU, SHARED = TIER_BIT["gpu"], TIER_BIT["shared"]
ENGINE = [101, 102, 103, 104, 105, 106, 107, 108]


def toks(n: int) -> list[int]:
    return list(range(1, 1 + n * BS))


class Connector:
    """llm-d's `StorageEventPublisher` on the wire (llm-d/llm-d-kv-cache 7be76e11 event_publisher.py): a PUB,
    frames `[b"kv@SHARED_STORAGE@<model>", seq (>Q, from 1), msgpack([ts, [bin event, ...]])]`."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        port = free_port()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    async def send(self, payload: bytes, *, seq: int | None = None) -> int:
        self.seq = self.seq + 1 if seq is None else seq
        await self.pub.send_multipart([b"kv@SHARED_STORAGE@test-model", struct.pack(">Q", self.seq), payload])
        return self.seq

    def close(self) -> None:
        self.pub.close(0)


@pytest.fixture
async def env(ctx):
    idx = KvIndex(default_block_size=BS)
    idx.set_storage_block_tokens(4 * BS)
    idx.set_shared_store("a", "pvc")
    idx.set_shared_store("b", "pvc")
    mgr = SubscriberManager(idx, zmq_context=ctx)
    gpu, conn = FakeWorker(ctx), Connector(ctx)
    await mgr.add("a", [KvSource(gpu.endpoint), KvSource(conn.endpoint, storage=True)])
    await gpu.sync(mgr, "a")
    storage = next(s for s in mgr._subs["a"] if s.source.storage)  # noqa: SLF001 - the storage stream's counters
    deadline = time.monotonic() + 10
    while storage.stats.last_seq is None:  # a PUB drops what it sends before the SUB is registered
        assert time.monotonic() < deadline, "the storage subscription never received"
        await conn.send(pack_storage_batch([]))
        await asyncio.sleep(0.02)
    yield idx, mgr, gpu, conn, storage
    await mgr.close()
    gpu.close()
    conn.close()


async def test_the_connectors_chunks_reach_the_index_and_every_store_member(env):
    idx, _, gpu, conn, storage = env
    await gpu.publish([stored_event(ENGINE, None, toks(8), BS)])
    await until_async(lambda: idx.blocks_indexed("a") == 8)
    seq = await conn.send(pack_storage_batch([storage_stored_event([104, 108])]))
    await until_async(lambda: storage.stats.last_seq == seq)
    await gpu.publish([removed_event(ENGINE)])
    await until_async(lambda: idx.blocks_indexed("a") == 0)
    chain = block_hashes(toks(8), BS)
    assert idx.overlap_tiers(chain, BS) == {"a": ((SHARED, 8),), "b": ((SHARED, 8),)}
    seq = await conn.send(pack_storage_batch([storage_removed_event([108])]))
    await until_async(lambda: storage.stats.last_seq == seq)
    assert idx.overlap_tiers(chain, BS) == {"a": ((SHARED, 4),), "b": ((SHARED, 4),)}


async def test_hostile_frames_on_the_storage_socket_are_counted_and_never_clear_the_worker(env):
    idx, mgr, gpu, conn, storage = env
    await gpu.publish([stored_event(ENGINE, None, toks(8), BS)])
    await until_async(lambda: idx.blocks_indexed("a") == 8)
    await conn.pub.send_multipart([b"kv@SHARED_STORAGE@test-model", b"short", b"x"])  # a bad seq frame
    await conn.send(b"\xc1 not msgpack")
    await conn.send(pack_storage_batch([b"\xc1", ["AllBlocksCleared"], storage_stored_event([104])]))
    seq = await conn.send(pack_storage_batch([storage_stored_event([108])]), seq=conn.seq + 5)  # a gap
    await until_async(lambda: storage.stats.last_seq == seq)
    st = idx.stats("a")
    assert st.garbage_frames == 1 and st.garbage_batches == 1 and st.garbage_events == 1
    assert st.unknown_events == 1 and storage.stats.gaps == 1
    assert idx.blocks_indexed("a") == 8  # neither garbage nor a gap on the storage stream clears GPU blocks
    await conn.send(pack_storage_batch([storage_stored_event([104])]), seq=1)  # the connector restarted
    await until_async(lambda: storage.stats.restarts == 1)
    assert idx.blocks_indexed("a") == 8
    assert idx.snapshot()["shared_stores"]["pvc"]["chunks"] == 2
    assert mgr.stats_snapshot()["a"]["kv_endpoints"][1]["endpoint"] == conn.endpoint
