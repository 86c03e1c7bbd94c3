"""A shard under `--kv-shared-stores` (issue 44 under `--kv-ingest apart`): it owns every member of a store
that hashes to it, and its tiers lookup answers what the index's `overlap_tiers` answers, by worker row."""

from __future__ import annotations

import pytest

from epp_extproc.dev.kvwire import pack_batch, pack_storage_batch, storage_stored_event, stored_event
from epp_extproc.ingest import wire
from epp_extproc.ingest.server import IngestShard
from kvindex.decode import decode_payload, decode_storage_payload
from kvindex.hashing import block_hashes
from kvindex.tiers import TIER_BIT

BS = 4
GPU, SHARED = TIER_BIT["gpu"], TIER_BIT["shared"]
MEMBERS = [f"10.0.0.{i}:8000" for i in range(8)]
STORES = dict.fromkeys(MEMBERS, "pvc")


def toks(n: int) -> list[int]:
    return list(range(1, 1 + n * BS))


async def test_every_member_of_a_store_is_owned_by_the_stores_shard_and_by_no_other(tmp_path) -> None:
    owner = wire.shard_of(MEMBERS[0], 4, STORES)
    assert len({wire.shard_of(a, 4) for a in MEMBERS}) > 1  # by address alone they would be split
    for k in range(4):
        s = IngestShard(str(tmp_path), k, 4, shared_stores=STORES)
        try:
            await s.want("p", {a: () for a in MEMBERS})
            assert set(s._current) == (set(MEMBERS) if k == owner else set())  # noqa: SLF001 - what it indexes
        finally:
            await s.close()


@pytest.fixture
async def shard(tmp_path):
    s = IngestShard(str(tmp_path), block_size=BS, shared_stores={"a:1": "pvc", "b:2": "pvc"},
                    storage_block_tokens=4 * BS)
    await s.want("p", {"a:1": (), "b:2": (), "c:3": ()})
    yield s
    await s.close()


async def test_a_tiers_lookup_answers_each_workers_runs_as_the_index_does(shard: IngestShard) -> None:
    idx = shard.index
    idx.apply_batch("a:1", decode_payload(pack_batch([stored_event(list(range(101, 109)), None, toks(8), BS)])))
    idx.apply_batch("c:3", decode_payload(pack_batch([stored_event([201, 202], None, toks(2), BS)])))
    shard._refresh_meta()  # noqa: SLF001 - the housekeeping's 50 ms tick
    assert not wire.Meta.decode(shard.meta_version, shard._meta).tiers  # noqa: SLF001 - GPU only so far
    idx.apply_storage_batch("a:1", decode_storage_payload(pack_storage_batch([storage_stored_event([104])])))
    shard._refresh_meta()  # noqa: SLF001
    meta = wire.Meta.decode(shard.meta_version, shard._meta)  # noqa: SLF001
    assert meta.tiers
    chain = block_hashes(toks(8), BS)
    _, _, _, flat = wire.unpack_answer(shard.answer(wire.pack_lookup(1, 0, True, [(BS, chain)], tiers=True)))
    got = {meta.workers[row]: runs for row, runs in wire.unpack_tier_runs(flat).items()}
    assert got == idx.overlap_tiers(chain, BS)
    assert got == {"a:1": ((GPU | SHARED, 4), (GPU, 4)), "b:2": ((SHARED, 4),), "c:3": ((GPU, 2),)}
    # the plain lookup is unchanged: one count per row, GPU blocks only
    _, _, _, counts = wire.unpack_answer(shard.answer(wire.pack_lookup(2, 0, True, [(BS, chain)])))
    assert dict(zip(meta.workers, counts, strict=True)) == {"a:1": 8, "b:2": 0, "c:3": 2}
