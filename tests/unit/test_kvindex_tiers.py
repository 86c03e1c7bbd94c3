"""Issue 44: the index keeps each block's tiers, reference-counted per (block, tier), and a tiered lookup
answers per worker the leading blocks at any tier with each position's tiers."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp_extproc.dev.kvwire import cleared_event, pack_batch, removed_event, stored_event
from kvindex.decode import decode_payload
from kvindex.hashing import block_hashes
from kvindex.index import KvIndex
from kvindex.tiers import TIER_BIT, medium_tier

BS = 4
GPU, CPU, DISK, SHARED, UNKNOWN = (TIER_BIT[t] for t in ("gpu", "cpu", "disk", "shared", "unknown"))


def toks(n_blocks: int, start: int = 1) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def batch(*events):
    return decode_payload(pack_batch(list(events)))


def store(idx, worker, hashes, tokens, parent=None, medium="GPU"):
    idx.apply_batch(worker, batch(stored_event(hashes, parent, tokens, BS, medium=medium)))


def remove(idx, worker, hashes, medium="GPU"):
    idx.apply_batch(worker, batch(removed_event(hashes, medium=medium)))


def chain(n_blocks: int) -> list[int]:
    return block_hashes(toks(n_blocks), BS)


@pytest.fixture
def idx():
    return KvIndex(default_block_size=BS)


@pytest.mark.parametrize(("medium", "tier"), [
    ("GPU", "gpu"), ("CPU", "cpu"), ("CPU_PINNED", "cpu"), ("CPU_TIER1", "cpu"), ("Disk", "disk"),
    ("DISK", "disk"), ("STORAGE", "disk"), ("CPU_TIER2", "disk"), ("EXTERNAL", "shared"),
    ("SHARED_STORAGE", "shared"), ("OBJECT_STORE", "shared"), ("NVLINK_POOL", "unknown"),
])
def test_each_engine_medium_maps_to_its_tier(medium, tier):
    assert medium_tier(medium) == tier


def test_cpu_store_is_indexed_under_the_cpu_tier_not_the_gpu_overlap(idx):
    store(idx, "w", [11, 12], toks(2), medium="CPU")
    assert idx.overlap_hashes(chain(2), BS) == {}
    assert idx.overlap_tiers(chain(2), BS) == {"w": ((CPU, 2),)}


def test_a_gpu_only_pool_has_no_tiers_and_equal_lookups(idx):
    store(idx, "w", [11, 12, 13], toks(3))
    assert not idx.has_tiers()
    assert idx.overlap_tiers(chain(3), BS) == {"w": ((GPU, 3),)}
    assert "tier_unique_blocks" not in idx.snapshot() and "blocks_by_tier" not in idx.snapshot()["workers"]["w"]


def test_prefix_continuing_on_the_host_after_the_gpu_part_is_one_run_per_tier(idx):
    store(idx, "w", [11, 12, 13, 14], toks(4))  # all four on the GPU
    store(idx, "w", [11, 12, 13, 14], toks(4), medium="CPU")  # offloaded too
    remove(idx, "w", [13, 14])  # the tail leaves the GPU, stays on the host
    assert idx.overlap_tiers(chain(4), BS) == {"w": ((GPU | CPU, 2), (CPU, 2))}
    assert idx.overlap_hashes(chain(4), BS) == {"w": 2}


def test_a_block_leaving_one_tier_stays_on_the_others(idx):
    store(idx, "w", [11], toks(1), medium="CPU")
    store(idx, "w", [11], toks(1), medium="DISK")
    remove(idx, "w", [11], medium="CPU")
    assert idx.overlap_tiers(chain(1), BS) == {"w": ((DISK, 1),)}


def test_a_reannounced_hash_is_one_copy_and_survives_one_chunks_removal(idx):
    # vLLM self-describing events: two chunks share block 12 and both announce it; one chunk is evicted
    store(idx, "w", [11, 12], toks(2), medium="CPU")
    store(idx, "w", [12, 13], toks(2, start=5), parent=11, medium="CPU")
    assert idx.tier_blocks("w")["cpu"] == 3
    remove(idx, "w", [11, 12], medium="CPU")
    assert idx.overlap_tiers(chain(3), BS) == {}  # block 11 is gone: the prefix starts nowhere
    assert idx.tier_blocks("w")["cpu"] == 2  # 12 is still held by the second chunk, 13 too
    remove(idx, "w", [12, 13], medium="CPU")
    assert idx.tier_blocks("w")["cpu"] == 0 and not idx.has_tiers()


def test_an_offload_chunk_of_several_gpu_blocks_is_counted_once_per_position(idx):
    # llm-d issue 2889: a large offload block split into smaller keys overcounted CPU hits
    store(idx, "w", [11, 12, 13, 14], toks(4), medium="CPU")
    store(idx, "w", [11, 12, 13, 14], toks(4), medium="CPU")  # re-announced by an overlapping chunk
    runs = idx.overlap_tiers(chain(4), BS)["w"]
    assert sum(n for _, n in runs) == 4


def test_a_host_chunk_chains_off_a_parent_that_left_the_gpu(idx):
    store(idx, "w", [11], toks(1), medium="CPU")
    store(idx, "w", [12], toks(1, start=5), parent=11)  # the GPU block's parent is only on the host now
    assert idx.overlap_tiers(chain(2), BS) == {"w": ((CPU, 1), (GPU, 1))}


# SGLang's own spellings (python/sglang/srt/disaggregation/kv_events.py): 0.5.9 and 0.5.10 `MEDIUM_GPU = "GPU"`,
# `MEDIUM_CPU = "CPU_PINNED"`; 0.5.15 to 0.5.23 `StorageMedium` GPU "GPU", CPU "CPU_PINNED", DISK "DISK",
# EXTERNAL "EXTERNAL". Events are positional arrays through 0.5.15 and tagged maps in 0.5.23.
SGLANG_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


def sglang_event(shape: str, tag: str, **fields):
    if shape == "map":
        return {"type": tag, **fields}
    order = SGLANG_STORED if tag == "BlockStored" else ("block_hashes", "medium")
    return [tag, *(fields[k] for k in order)]


@pytest.mark.parametrize("shape", ["array", "map"])
def test_sglang_hicache_media_decode_to_their_tiers_as_its_releases_send_them(idx, shape):
    def stored(hashes, medium):
        return sglang_event(shape, "BlockStored", block_hashes=hashes, parent_block_hash=None,
                            token_ids=toks(len(hashes)), block_size=BS, lora_id=None, medium=medium)

    # HiCache write-through (0.5.23 mem_cache/unified_cache/unified_tree_core.py, 0.5.15 hiradix_cache.py): the
    # GPU store, the host backup at CPU_PINNED, then the GPU copy evicted while the host copy stays
    idx.apply_batch("w", batch(stored([11, 12], "GPU"), stored([11, 12], "CPU_PINNED"),
                               sglang_event(shape, "BlockRemoved", block_hashes=[11, 12], medium="GPU")))
    assert idx.overlap_tiers(chain(2), BS) == {"w": ((CPU, 2),)}
    # the enum's storage members (defined; 0.5.23 sends neither yet)
    idx.apply_batch("d", batch(stored([11, 12], "DISK")))
    idx.apply_batch("x", batch(stored([11, 12], "EXTERNAL")))
    assert idx.overlap_tiers(chain(2), BS) == {"w": ((CPU, 2),), "d": ((DISK, 2),), "x": ((SHARED, 2),)}
    assert all(idx.stats(w).unknown_medium == 0 and idx.stats(w).garbage_events == 0 for w in "wdx")


def test_unknown_media_are_kept_and_counted(idx):
    store(idx, "w", [11], toks(1), medium="HBM_POOL")
    assert idx.overlap_tiers(chain(1), BS) == {"w": ((UNKNOWN, 1),)}
    assert idx.stats("w").unknown_medium == 1


def test_placeholder_offload_events_are_skipped_and_counted_not_garbage(idx):
    ev = stored_event([99], None, [], 0, medium="CPU")
    idx.apply_batch("w", batch(ev))
    st = idx.stats("w")
    assert (st.skipped_placeholder, st.garbage) == (1, 0)
    assert not idx.has_tiers()


def test_a_placeholder_removal_is_an_unknown_off_gpu_removal(idx):
    remove(idx, "w", [99], medium="CPU")
    st = idx.stats("w")
    assert (st.tier_removed_unknown, st.blocks_removed, st.garbage) == (1, 0, 0)


def test_clear_drops_every_tier(idx):
    store(idx, "w", [11], toks(1), medium="CPU")
    idx.apply_batch("w", batch(cleared_event()))
    assert idx.overlap_tiers(chain(1), BS) == {} and not idx.has_tiers()


def test_dropping_a_worker_frees_its_tier_entries(idx):
    store(idx, "w", [11], toks(1), medium="CPU")
    store(idx, "v", [11], toks(1), medium="CPU")
    idx.drop_worker("w")
    assert idx.overlap_tiers(chain(1), BS) == {"v": ((CPU, 1),)}
    idx.drop_worker("v")
    assert not idx.has_tiers()


def test_predictions_count_as_gpu_in_a_tiered_lookup(idx):
    store(idx, "w", [11, 12], toks(2), medium="CPU")
    idx.predict_hashes("w", chain(1), ttl_s=60)
    assert idx.overlap_tiers(chain(2), BS) == {"w": ((GPU | CPU, 1), (CPU, 1))}
    assert idx.overlap_tiers(chain(2), BS, predicted=False) == {"w": ((CPU, 2),)}


def test_tiered_lookup_keeps_each_worker_its_own_runs(idx):
    store(idx, "a", [11, 12], toks(2))
    store(idx, "b", [21, 22, 23], toks(3), medium="CPU")
    assert idx.overlap_tiers(chain(3), BS) == {"a": ((GPU, 2),), "b": ((CPU, 3),)}
    assert idx.overlap_tiers(chain(3), BS, ["a"]) == {"a": ((GPU, 2),)}


def test_debug_kv_shows_blocks_per_tier_where_a_tier_was_seen(idx):
    store(idx, "w", [11, 12], toks(2))
    store(idx, "w", [11], toks(1), medium="CPU")
    snap = idx.snapshot()
    assert snap["workers"]["w"]["blocks_by_tier"] == {"gpu": 2, "cpu": 1}
    assert snap["tier_unique_blocks"] == {"cpu": 1}


def test_a_tier_map_is_capped_like_the_gpu_map():
    idx = KvIndex(default_block_size=BS, max_blocks_per_worker=4)
    for i in range(6):
        store(idx, "w", [100 + i], toks(1, start=1 + 10 * i), medium="CPU")
    assert idx.tier_blocks("w")["cpu"] <= 4


def test_a_shared_tier_block_is_credited_to_every_worker_mounting_the_store(idx):
    idx.set_shared_store("a", "pool")
    idx.set_shared_store("b", "pool")
    store(idx, "a", [11, 12], toks(2), medium="EXTERNAL")
    store(idx, "c", [99], toks(1, start=500))  # c mounts nothing
    assert idx.overlap_tiers(chain(2), BS) == {"a": ((SHARED, 2),), "b": ((SHARED, 2),)}


def test_without_a_configured_store_a_shared_block_is_the_publishers_alone(idx):
    store(idx, "a", [11], toks(1), medium="SHARED_STORAGE")
    store(idx, "b", [99], toks(1, start=500))
    assert idx.overlap_tiers(chain(1), BS) == {"a": ((SHARED, 1),)}


def test_host_blocks_are_never_shared_with_the_store(idx):
    idx.set_shared_store("a", "pool")
    idx.set_shared_store("b", "pool")
    store(idx, "a", [11], toks(1), medium="CPU")
    assert idx.overlap_tiers(chain(1), BS) == {"a": ((CPU, 1),)}


def test_shared_stores_parse_and_refuse_a_worker_in_two():
    from kvindex.tiers import parse_shared_stores

    assert parse_shared_stores("p=a:1,b:2; q=c:3") == {"a:1": "p", "b:2": "p", "c:3": "q"}
    with pytest.raises(ValueError, match="two shared stores"):
        parse_shared_stores("p=a:1;q=a:1")


def test_debug_kv_says_why_placeholder_offload_events_earn_nothing(idx):
    idx.apply_batch("w", batch(stored_event([99], None, [], 0, medium="CPU")))
    assert "self_describing_kv_events" in idx.snapshot()["workers"]["w"]["tier_note"]


def test_placeholder_offload_events_are_warned_about_once(idx, caplog):
    for _ in range(3):
        idx.apply_batch("w", batch(stored_event([99], None, [], 0, medium="CPU")))
    assert sum("self_describing_kv_events" in r.getMessage() for r in caplog.records) == 1


def test_an_offloaded_salted_block_keeps_the_salt_its_gpu_store_carried(idx):
    # vLLM's self-describing offload events carry no extra_keys: the salt is only in the GPU event
    idx.apply_batch("w", batch(stored_event([11, 12], None, toks(2), BS, extra_keys=[["tenant"], None])))
    store(idx, "w", [11, 12], toks(2), medium="CPU")
    salted = block_hashes(toks(2), BS, salt="tenant")
    assert idx.overlap_tiers(salted, BS) == {"w": ((GPU | CPU, 2),)}
    assert idx.overlap_tiers(chain(2), BS) == {}


TIER_OF_MEDIUM = {"GPU": GPU, "CPU": CPU, "DISK": DISK}


def per_worker_walk(holds: dict[str, set[int]], n: int) -> tuple[tuple[int, int], ...]:
    """The tiered lookup's meaning for one worker, position by position: the tiers holding each leading
    position, consecutive equal codes as one run, up to the first position no tier holds."""
    runs: list[list[int]] = []
    for i in range(n):
        code = 0
        for medium, positions in holds.items():
            if i in positions:
                code |= TIER_OF_MEDIUM[medium]
        if not code:
            break
        if runs and runs[-1][0] == code:
            runs[-1][1] += 1
        else:
            runs.append([code, 1])
    return tuple((c, k) for c, k in runs)


N_POS = 12
_holding = st.tuples(st.integers(0, N_POS), st.sets(st.integers(0, N_POS - 1), max_size=4))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.fixed_dictionaries({m: _holding for m in TIER_OF_MEDIUM}), min_size=1, max_size=6))
def test_tiered_lookup_equals_a_per_worker_walk_for_any_holdings(workers):
    idx = KvIndex(default_block_size=BS)
    want = {}
    for w, tiers in enumerate(workers):
        holds: dict[str, set[int]] = {}
        for medium, (k, holes) in tiers.items():
            if not k:
                continue
            hs = [w * 10_000 + TIER_OF_MEDIUM[medium] * 100 + j for j in range(k)]
            store(idx, f"w{w}", hs, toks(k), medium=medium)
            gone = sorted(j for j in holes if j < k)
            if gone:
                remove(idx, f"w{w}", [hs[j] for j in gone], medium=medium)
            holds[medium] = set(range(k)) - set(gone)
        runs = per_worker_walk(holds, N_POS)
        if runs:
            want[f"w{w}"] = runs
    assert idx.overlap_tiers(chain(N_POS), BS) == want


def test_a_tiered_lookup_costs_a_few_walks_when_gpu_prefixes_end_at_many_positions():
    """Issue 44's second lookup: each change of the position's tiers used to go over every slot, so a pool
    whose GPU prefixes end at many different positions cost (positions x slots): 85x the GPU walk at 256
    workers and 32k tokens, 220 ms at a thousand. Compared with the plain walk over the same index in the
    same run (the best of several tries of each), so a busy machine weighs on both alike: about 8x here,
    325x before."""
    idx = KvIndex(default_block_size=BS)
    n_blocks, n_workers = 200, 300
    for w in range(n_workers):
        k = 1 + (w * 7919) % n_blocks  # GPU prefixes ending at ~200 different positions
        store(idx, f"w{w}", [w * 10_000 + j for j in range(k)], toks(k))
        if w % 2:
            store(idx, f"w{w}", [w * 10_000 + 5_000 + j for j in range(n_blocks)], toks(n_blocks), medium="CPU")
    hashes = chain(n_blocks)

    def best(f) -> float:
        out = []
        for _ in range(7):
            t = time.perf_counter()
            f()
            out.append(time.perf_counter() - t)
        return min(out)

    walk = best(lambda: idx.overlap_hashes(hashes, BS))
    tiers = best(lambda: idx.overlap_tiers(hashes, BS))
    assert tiers < 40 * walk, (tiers * 1e3, walk * 1e3)
