"""The simulated paged KV cache: reuse rules (last token, salts), LRU eviction, pinning, and cached_tokens."""

from __future__ import annotations

import aiohttp

from tests.mock.test_mock_support import ids_body, post, running_worker
from trtllm_mock.kvcache import KVCache, wire_hash

TPB = 4


def ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def run_request(cache: KVCache, prompt: list[int], salt: str | None = None, out: int = 1) -> tuple[int, list[dict]]:
    """Admit, prefill and release one request; returns (cached tokens, events)."""
    admitted = cache.admit(prompt, salt, len(prompt) + out)
    assert admitted is not None
    alloc, events = admitted
    events = events + cache.commit_prefill(alloc)
    cache.release(alloc)
    return alloc.cached_tokens, events


def test_prompt_of_exactly_k_full_blocks_reuses_at_most_k_minus_one():
    cache = KVCache(TPB, 64)
    run_request(cache, ids(3 * TPB))
    cached, _ = run_request(cache, ids(3 * TPB))
    assert cached == 2 * TPB


def test_one_more_token_makes_the_last_full_block_reusable():
    cache = KVCache(TPB, 64)
    run_request(cache, ids(3 * TPB))
    cached, _ = run_request(cache, ids(3 * TPB + 1))
    assert cached == 3 * TPB


def test_partial_tail_block_is_neither_stored_nor_published():
    cache = KVCache(TPB, 64)
    _, events = run_request(cache, ids(2 * TPB + 3))
    assert len(cache.blocks) == 2
    assert [len(e["token_ids"]) for e in events] == [2 * TPB]


def test_reuse_stops_at_the_first_differing_block():
    cache = KVCache(TPB, 64)
    run_request(cache, ids(4 * TPB))
    changed = ids(4 * TPB)
    changed[TPB + 1] = 7  # second block differs
    cached, _ = run_request(cache, changed + [1])
    assert cached == TPB


def test_salted_request_does_not_reuse_unsalted_blocks():
    cache = KVCache(TPB, 64)
    run_request(cache, ids(3 * TPB))
    cached, _ = run_request(cache, ids(3 * TPB), salt="tenant-a")
    assert cached == 0


def test_same_salt_reuses_and_other_salt_does_not():
    cache = KVCache(TPB, 64)
    run_request(cache, ids(3 * TPB), salt="tenant-a")
    assert run_request(cache, ids(3 * TPB), salt="tenant-a")[0] == 2 * TPB
    assert run_request(cache, ids(3 * TPB), salt="tenant-b")[0] == 0


def test_salt_changes_engine_hashes_but_published_token_ids_look_unsalted():
    cache = KVCache(TPB, 64)
    _, plain = run_request(cache, ids(2 * TPB))
    _, salted = run_request(cache, ids(2 * TPB), salt="tenant-a")
    assert plain[0]["token_ids"] == salted[0]["token_ids"]
    assert set(plain[0]["block_hashes"]).isdisjoint(salted[0]["block_hashes"])


def test_new_blocks_of_a_chain_are_coalesced_with_the_parent_of_the_last_reused_block():
    cache = KVCache(TPB, 64)
    _, first = run_request(cache, ids(2 * TPB + 1))
    _, second = run_request(cache, ids(5 * TPB + 1))
    assert len(second) == 1
    event = second[0]
    assert event["parent_block_hash"] == first[0]["block_hashes"][-1]
    assert len(event["block_hashes"]) == 3
    assert event["token_ids"] == ids(5 * TPB)[2 * TPB :]


def test_root_block_event_has_nil_parent():
    cache = KVCache(TPB, 64)
    _, events = run_request(cache, ids(TPB + 1))
    assert events[0]["parent_block_hash"] is None


def test_lru_eviction_removes_the_least_recently_used_unreferenced_blocks():
    cache = KVCache(TPB, 4)
    _, old = run_request(cache, ids(TPB, start=100), out=1)  # 1 cached block
    _, recent = run_request(cache, ids(TPB, start=200), out=1)  # 1 cached block
    run_request(cache, ids(TPB, start=100), out=1)  # touch "old": now "recent" is the LRU one
    _, events = run_request(cache, ids(2 * TPB, start=300), out=1)  # needs 3 blocks: one eviction
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert removed and removed[0]["block_hashes"] == recent[0]["block_hashes"]
    assert cache.match(ids(TPB, start=100) + [1], None)  # "old" survived


def test_eviction_takes_leaves_before_their_parents():
    cache = KVCache(TPB, 4)
    _, stored = run_request(cache, ids(2 * TPB), out=TPB)  # 2-block chain
    _, events = run_request(cache, ids(TPB, start=900), out=2 * TPB)  # needs 3 blocks: evicts one
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed == [stored[0]["block_hashes"][1]]


def test_blocks_referenced_by_a_running_request_are_pinned():
    cache = KVCache(TPB, 4)
    admitted = cache.admit(ids(2 * TPB), None, 2 * TPB + 1)  # 3 blocks, still running
    assert admitted is not None
    cache.commit_prefill(admitted[0])
    assert cache.admit(ids(TPB, start=900), None, 2 * TPB) is None  # needs 2, only 1 free and nothing evictable
    cache.release(admitted[0])
    assert cache.admit(ids(TPB, start=900), None, 2 * TPB) is not None


def test_hashes_with_the_top_bit_set_are_published_as_negative_int64():
    assert wire_hash((1 << 64) - 1) == -1
    assert wire_hash(1 << 63) == -(1 << 63)
    assert wire_hash(12345) == 12345


def test_some_published_block_hashes_are_negative():
    cache = KVCache(TPB, 4096)
    _, events = run_request(cache, ids(64 * TPB), out=1)
    hashes = events[0]["block_hashes"]
    assert any(h < 0 for h in hashes) and any(h >= 0 for h in hashes)


def test_clear_forgets_every_block():
    cache = KVCache(TPB, 64)
    run_request(cache, ids(3 * TPB))
    cache.clear()
    assert cache.blocks == {} and run_request(cache, ids(3 * TPB))[0] == 0


async def test_cached_tokens_in_usage_follow_the_last_token_rule():
    async with running_worker(tokens_per_block=TPB, kv_events=False) as w, aiohttp.ClientSession() as s:
        _, first = await post(s, w.url + "/v1/chat/completions", ids_body(ids(2 * TPB)))
        _, again = await post(s, w.url + "/v1/chat/completions", ids_body(ids(2 * TPB)))
        _, longer = await post(s, w.url + "/v1/chat/completions", ids_body(ids(2 * TPB + 1)))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == TPB
    assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * TPB


async def test_cached_tokens_in_usage_respect_salts():
    async with running_worker(tokens_per_block=TPB, kv_events=False) as w, aiohttp.ClientSession() as s:
        url = w.url + "/v1/chat/completions"
        await post(s, url, ids_body(ids(3 * TPB), cache_salt="a"))
        _, other = await post(s, url, ids_body(ids(3 * TPB), cache_salt="b"))
        _, same = await post(s, url, ids_body(ids(3 * TPB), cache_salt="a"))
        _, unsalted = await post(s, url, ids_body(ids(3 * TPB)))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * TPB
    assert unsalted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_completions_reuse_blocks_stored_by_chat_with_the_same_ids():
    async with running_worker(tokens_per_block=TPB, kv_events=False) as w, aiohttp.ClientSession() as s:
        await post(s, w.url + "/v1/chat/completions", ids_body(ids(3 * TPB)))
        _, out = await post(s, w.url + "/v1/completions", {"model": "m", "prompt": ids(3 * TPB + 1), "max_tokens": 1})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * TPB


async def test_stats_total_cached_tokens_matches_usage():
    async with running_worker(tokens_per_block=TPB, kv_events=False) as w, aiohttp.ClientSession() as s:
        for _ in range(3):
            await post(s, w.url + "/v1/chat/completions", ids_body(ids(2 * TPB + 1)))
        async with s.get(w.url + "/mock/stats") as r:
            stats = await r.json()
    assert stats["cached_tokens_total"] == 2 * 2 * TPB
    assert stats["requests_served"] == 3 and stats["inference_requests"] == 3
