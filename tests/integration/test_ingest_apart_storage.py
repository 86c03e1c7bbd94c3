"""Integration (issue 44 under `--kv-ingest apart`): llm-d's file-system connector stream read by the ingest
shards, credited to every worker mounting the store, as the in-process index credits it.

Real ZeroMQ publishers (each worker's GPU event PUB with its replay socket, and a PUB playing the connector),
two real shard processes, real Unix sockets; an in-process `KvRouting` fed by the same publishers is the
reference. The two store members are chosen so that the address hash alone would put them in different shards:
the store's chunks are resolved through its members' GPU events and credited to every member, so all of a
store's workers must meet in one shard's index.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import zmq.asyncio

from epp_extproc.adapters.kv_remote import RemoteKv
from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.config import Config
from epp_extproc.core.contract import PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.request import RequestContext
from epp_extproc.dev.kvwire import pack_storage_batch, removed_event, storage_stored_event
from epp_extproc.ingest import wire
from epp_extproc.ingest.launcher import IngestGroup, shard_argv
from epp_extproc.metrics import PickerMetrics
from kvindex.tiers import TIER_BIT
from tests.integration.test_ingest_apart import BS, Publisher, tokens
from tests.integration.test_kvindex_storage_subscriber import Connector
from tests.scheduling_fakes import TokensRenderer, build_decider
from tests.waiting import until_async

SHARDS = 2
CHUNK = 4 * BS  # --kv-storage-block-size: a chunk is 4 GPU blocks
GPU, SHARED = TIER_BIT["gpu"], TIER_BIT["shared"]


def split_pair() -> tuple[str, str]:
    """Two worker addresses the address hash puts in different shards (the case a store must survive)."""
    first = "127.0.0.1:9100"
    for port in range(9101, 9200):
        other = f"127.0.0.1:{port}"
        if wire.shard_of(other, SHARDS) != wire.shard_of(first, SHARDS):
            return first, other
    raise AssertionError("no two addresses in different shards")


A0, A1 = split_pair()
A2 = "127.0.0.1:9300"  # mounts no store
STORES = {A0: "pvc", A1: "pvc"}
SPEC = f"pvc={A0},{A1}"


@pytest.fixture
def sock_dir():
    with tempfile.TemporaryDirectory(prefix="epp-ingest-") as d:
        yield d


@pytest.fixture
def shards(sock_dir):
    group = IngestGroup([shard_argv(sock_dir, k, SHARDS, block_size=BS, max_blocks_per_worker=10_000, topic="",
                                    worker_cpu_share=0.25, log_level="WARNING", shared_stores=SPEC,
                                    storage_block_size=CHUNK) for k in range(SHARDS)])
    group.start()
    yield group
    group.stop()


async def _snap(kv: KvRouting | RemoteKv) -> dict[str, Any]:
    s = kv.snapshot()
    return await s if asyncio.iscoroutine(s) else s  # type: ignore[return-value]


async def until_both(local: KvRouting, kv: RemoteKv, ok: Callable[[dict[str, Any]], bool]) -> None:
    """Until `ok` holds of both views' `/debug/kv` snapshot."""
    async def both() -> bool:
        return ok(await _snap(local)) and ok(await _snap(kv))
    for _ in range(200):
        if await both():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the two views never agreed on the condition")


async def decide(view: KvRouting | RemoteKv, registry: EndpointRegistry, prompt: list[int],
                 ingest: str) -> tuple[str, list[float]]:
    """A decision of the tiered-credit pipeline over `view`: (the chosen worker, each worker's credited)."""
    renderer = TokensRenderer()
    renderer.tokens = prompt
    config = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1",
                    kv_cache_block_size=BS, tiered_credit=True, kv_ingest=ingest, kv_shared_stores=SPEC,
                    kv_storage_block_size=CHUNK)
    config.validate()
    metrics = PickerMetrics()
    pipe = build_decider(config, registry, LoadTracker(metrics.endpoint_inflight), metrics, renderer=renderer,
                         kv=view)
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    p = await pipe.propose(RequestContext(method="POST", path="/v1/chat/completions", headers={}, body=body))
    t = p.primary.table
    return p.address, [t.credited[t.row(a)] for a in (A0, A1, A2)]


async def test_a_prefix_held_only_on_shared_storage_is_credited_to_every_mounting_worker_as_in_process(
        ctx: zmq.asyncio.Context, sock_dir: str, shards: IngestGroup) -> None:
    pubs = {a: Publisher(ctx) for a in (A0, A1, A2)}
    conns = {a: Connector(ctx) for a in (A0, A1)}
    eps = [Endpoint(f"w{i}", a, p.endpoint, p.replay, kv_storage_events=conns[a].endpoint if a in conns else None)
           for i, (a, p) in enumerate(pubs.items())]
    reg_local, reg_remote = EndpointRegistry(), EndpointRegistry()
    local = KvRouting(reg_local, block_size=BS, max_blocks_per_worker=10_000, topic="", prediction_ttl_s=0.0,
                      metrics_registry=None, ask_server_info=False)
    local.set_shared_stores(STORES)
    local.set_storage_block_tokens(CHUNK)
    kv = RemoteKv(reg_remote, directory=sock_dir, shards=SHARDS, block_size=BS, prediction_ttl_s=0.0,
                  lookup_timeout_s=0.5, client_id="t", ask_server_info=False, shared_stores=STORES)
    kv.start()
    addrs = [A0, A1, A2]
    try:
        reg_local.replace(eps)
        reg_remote.replace(eps)
        # a PUB drops what it sends before a SUB joined and the connector has no replay: empty batches until
        # both views read each connector
        for _ in range(200):
            for c in conns.values():
                await c.send(pack_storage_batch([]))
            await asyncio.sleep(0.05)
            snaps = [await _snap(local), await _snap(kv)]
            if all(s["workers"].get(a, {}).get("storage_batches", 0) > 0 for s in snaps for a in conns):
                break
        else:
            raise AssertionError("a storage subscription never received")
        chain = await pubs[A0].store(tokens(8))  # 8 GPU blocks = 2 chunks, on A0's GPU
        await pubs[A1].store(tokens(2))  # the first 2 blocks on A1's GPU too
        await pubs[A2].store(tokens(3))
        held = {A0: 8, A1: 2, A2: 3}
        await until_both(local, kv, lambda s: all(s["workers"].get(a, {}).get("blocks_indexed") == n
                                                  for a, n in held.items()))
        # the connector keys a chunk by its last GPU block's engine hash; A1's names one nobody's GPU event did
        await conns[A0].send(pack_storage_batch([storage_stored_event([chain[3], chain[7]])]))
        await conns[A1].send(pack_storage_batch([storage_stored_event([999_999])]))
        await conns[A1].send(b"\xc1 not msgpack")  # a hostile batch: counted and dropped
        await pubs[A0].publish([removed_event(chain)])  # evicted from A0's GPU: the prefix is only on storage
        await until_both(local, kv, lambda s: s["workers"].get(A0, {}).get("blocks_indexed") == 0
                         and s["workers"][A0].get("store_chunks_stored") == 2
                         and s["workers"][A1].get("store_unresolved") == 1
                         and s["workers"][A1].get("garbage_batches") == 1)
        prompt = tokens(8) + [7]
        want = {A0: ((SHARED, 8),), A1: ((GPU | SHARED, 2), (SHARED, 6)), A2: ((GPU, 3),)}
        assert local.tiers(local.prompt(prompt, PromptIdentity()), addrs) == want
        await until_async(kv.has_tiers)  # the shard's table says so within its next push (50 ms)
        assert kv.tiers(kv.prompt(prompt, PromptIdentity()), addrs) == want
        for p in (tokens(3), tokens(4) + [1], tokens(12)):  # a partial chunk, one chunk, past the store
            assert kv.tiers(kv.prompt(p, PromptIdentity()), addrs) == \
                local.tiers(local.prompt(p, PromptIdentity()), addrs)
        snap_local, snap_remote = await _snap(local), await _snap(kv)
        assert snap_remote["shared_stores"] == snap_local["shared_stores"]
        assert snap_remote["shared_stores"]["pvc"]["chunks"] == 2
        for a in (A0, A1):
            assert snap_remote["workers"][a]["blocks_by_tier"] == snap_local["workers"][a]["blocks_by_tier"]
        # the same decision through the tiered-credit plugin: A1 (2 GPU blocks, then 6 on the store it mounts)
        # over A2 (3 GPU blocks, no store) and A0 (8 on the store, none on its GPU)
        picked = [await decide(local, reg_local, prompt, "inprocess"), await decide(kv, reg_remote, prompt, "apart")]
        assert picked[0] == picked[1]
        assert picked[0][0] == A1 and picked[0][1] == pytest.approx([2.0, 2 + 6 * 0.25, 3.0])
    finally:
        await kv.close()
        await local.close()
        for p in pubs.values():
            p.close()
        for c in conns.values():
            c.close()
