"""The mock's off-GPU tiers (issue 44): GPU evictions offloaded to host memory, host evictions to storage, then
away; prompts continuing into them load instead of computing; tier moves published per engine dialect; the
picker's index following them."""

from __future__ import annotations

import msgpack
import pytest

from kvindex.decode import decode_payload
from kvindex.index import KvIndex
from trtllm_mock.config import LOAD_VS_PREFILL, MockConfig
from trtllm_mock.engine import Engine
from trtllm_mock.events import KvEventPublisher
from trtllm_mock.kvcache import KVCache, wire_hash

TPB = 4


def ids(n_blocks: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n_blocks * TPB))


def run(cache: KVCache, prompt: list[int]) -> tuple[int, list[str], list[dict]]:
    """Admit, prefill and release one request: (cached tokens, loaded media, events)."""
    admitted = cache.admit(prompt, None, len(prompt) + 1)
    assert admitted is not None
    alloc, events = admitted
    events = events + cache.commit_prefill(alloc)
    cache.release(alloc)
    return alloc.cached_tokens, alloc.loaded, events


def fill(cache: KVCache, n: int) -> None:
    """`n` one-request chains of 2 blocks each (plus the unreusable last token)."""
    for i in range(n):
        run(cache, ids(2, start=10_000 * (i + 1)) + [1])


def test_a_gpu_eviction_offloads_the_block_to_host_memory_and_says_so():
    cache = KVCache(TPB, 5, host_blocks=8)
    run(cache, ids(2) + [1])
    first = [wire_hash(h) for h in cache.chain_hashes(ids(2), None)]
    _, _, events = run(cache, ids(3, start=50_000) + [1])  # needs 4 blocks: 2 of the first chain evicted
    removed = [e for e in events if e["type"] == "BlockRemoved" and e["medium"] == "GPU"]
    stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    assert removed and sorted(h for e in stored for h in e["block_hashes"]) == sorted(removed[0]["block_hashes"])
    assert set(cache.snapshot()["tiers"]["CPU"]) <= set(first) and cache.snapshot()["tiers"]["CPU"]


def test_a_host_eviction_goes_to_storage_then_away():
    cache = KVCache(TPB, 3, host_blocks=2, storage_blocks=2)
    fill(cache, 6)
    snap = cache.snapshot()["tiers"]
    assert len(snap["CPU"]) == 2 and len(snap["DISK"]) == 2


def test_a_prompt_continuing_into_host_memory_loads_those_blocks():
    cache = KVCache(TPB, 4, host_blocks=16)
    run(cache, ids(3) + [1])
    fill(cache, 3)  # pushes the first chain off the GPU
    cached, loaded, events = run(cache, ids(3) + [1])
    assert cached == 3 * TPB and loaded == ["CPU"] * 3
    # loaded blocks are GPU blocks again once the prefill commits
    assert any(e["type"] == "BlockStored" and e["medium"] == "GPU" for e in events)


def test_without_tiers_the_cache_is_gpu_only():
    cache = KVCache(TPB, 4)
    run(cache, ids(3) + [1])
    fill(cache, 3)
    cached, loaded, _ = run(cache, ids(3) + [1])
    assert (cached, loaded) == (0, []) and cache.snapshot()["tiers"] == {}


def test_load_time_is_the_tiers_fixed_fraction_of_the_prefill_per_token():
    cfg = MockConfig(tokens_per_block=TPB, num_blocks=4, host_blocks=16, kv_events=False,
                     prefill_ms_per_token=0.5)
    engine = Engine(cfg, KVCache(TPB, 4, host_blocks=16), None)
    alloc = engine.cache.admit(ids(2) + [1], None, 10)[0]
    alloc.loaded = ["CPU", "DISK"]
    assert engine._load_ms(alloc) == pytest.approx(TPB * 0.5 * (LOAD_VS_PREFILL["CPU"] + LOAD_VS_PREFILL["DISK"]))


def test_the_load_time_model_is_64_kib_per_token_over_25_and_5_gb_per_s():
    assert LOAD_VS_PREFILL["CPU"] * 0.0142 == pytest.approx(65536 / 25e9 * 1000)
    assert LOAD_VS_PREFILL["DISK"] == pytest.approx(5 * LOAD_VS_PREFILL["CPU"])


def offload_events(dialect: str) -> list:
    cache = KVCache(TPB, 4, host_blocks=16, storage_blocks=0)
    run(cache, ids(3) + [1])
    events: list[dict] = []
    for i in range(3):
        events += run(cache, ids(2, start=10_000 * (i + 1)) + [1])[2]
    pub = KvEventPublisher(MockConfig(event_dialect=dialect, kv_events=False))
    return pub.to_dialect(events)


@pytest.mark.parametrize(("dialect", "medium"), [("vllm", "CPU"), ("sglang", "CPU_PINNED")])
def test_each_engine_dialect_spells_the_host_medium_its_way(dialect, medium):
    media = {e["medium"] for e in offload_events(dialect)}
    assert medium in media


def test_the_trtllm_dialect_publishes_no_tier_moves():
    assert {e["medium"] for e in offload_events("trtllm")} == {"GPU"}


@pytest.mark.parametrize(("dialect", "on_compute"), [("vllm", False), ("vllm", True), ("sglang", False)])
def test_the_pickers_index_holds_exactly_the_mocks_tiers(dialect, on_compute):
    cache = KVCache(TPB, 5, host_blocks=6, storage_blocks=4, offload_on_compute=on_compute)
    pub = KvEventPublisher(MockConfig(event_dialect=dialect, kv_events=False, tokens_per_block=TPB))
    idx = KvIndex(default_block_size=TPB)
    for i in range(12):
        prompt = ids(2 + i % 2, start=1000 * (1 + i % 5)) + [1]
        admitted = cache.admit(prompt, None, len(prompt) + 1)
        assert admitted is not None
        alloc, events = admitted
        events = events + cache.commit_prefill(alloc)
        cache.release(alloc)
        idx.apply_batch("w", decode_payload(msgpack.packb([0.0, pub.to_dialect(events), 0])))
    snap = cache.snapshot()
    held = idx.tier_blocks("w")
    assert held["gpu"] == snap["cached_blocks"]
    assert held.get("cpu", 0) == len(snap["tiers"]["CPU"]) and held.get("disk", 0) == len(snap["tiers"]["DISK"])
    assert idx.stats("w").garbage == 0 and idx.stats("w").skipped_unknown_parent == 0


def stored(events: list[dict], medium: str) -> list[int]:
    return [h for e in events if e["type"] == "BlockStored" and e["medium"] == medium for h in e["block_hashes"]]


def test_offload_on_compute_stores_a_prefills_blocks_in_host_memory_at_once():
    cache = KVCache(TPB, 8, host_blocks=8, offload_on_compute=True)
    _, _, events = run(cache, ids(2) + [1])
    chain = [wire_hash(h) for h in cache.chain_hashes(ids(2), None)]
    assert stored(events, "GPU") == chain and stored(events, "CPU") == chain  # GPU first, then its host copy
    assert [e["medium"] for e in events if e["type"] == "BlockStored"] == ["GPU", "CPU", "CPU"]
    assert cache.snapshot()["tiers"]["CPU"] == chain


def test_offload_on_compute_stores_a_block_once_and_an_eviction_adds_no_host_copy():
    cache = KVCache(TPB, 5, host_blocks=16, offload_on_compute=True)
    run(cache, ids(2) + [1])
    _, _, again = run(cache, ids(2) + [1])
    assert stored(again, "CPU") == []  # held already: touched, not stored again
    _, _, evicting = run(cache, ids(3, start=50_000) + [1])  # evicts the first chain from the GPU
    assert any(e["type"] == "BlockRemoved" and e["medium"] == "GPU" for e in evicting)
    assert stored(evicting, "CPU") == [wire_hash(h) for h in cache.chain_hashes(ids(3, start=50_000), None)]
    cached, loaded, _ = run(cache, ids(2) + [1])
    assert loaded == ["CPU"] and cached == 2 * TPB  # its evicted block still loads from host memory


def test_host_offload_follows_the_engine_each_dialect_stands_for():
    assert MockConfig(event_dialect="vllm").offloads_on_compute
    assert MockConfig(event_dialect="vllm-array").offloads_on_compute
    assert not MockConfig(event_dialect="sglang").offloads_on_compute
    assert not MockConfig(event_dialect="vllm", host_offload="evict").offloads_on_compute


def test_offload_on_compute_keeps_what_was_computed_last_not_what_was_evicted_last():
    def a_after_eviction(on_compute: bool) -> list[str]:
        cache = KVCache(TPB, 5, host_blocks=3, offload_on_compute=on_compute)
        run(cache, ids(2) + [1])  # A
        run(cache, ids(2, start=20_000) + [1])  # B: with on_compute, B's copies push A's out of host memory
        run(cache, ids(3, start=50_000) + [1])  # C evicts A from the GPU
        return run(cache, ids(2) + [1])[1]

    assert a_after_eviction(on_compute=False) == ["CPU", "CPU"]  # the eviction put A in host memory
    assert a_after_eviction(on_compute=True) == []  # host memory holds the last computed: C's blocks
