"""The picker's one-pass prompt hashing agrees with the index's own token-based lookups."""

from __future__ import annotations

from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.adapters.worker_facts import Prompt
from epp_extproc.core.endpoints import EndpointRegistry
from kvindex.index import KvIndex


def routing(block_sizes: dict[str, int]) -> KvRouting:
    kv = KvRouting(EndpointRegistry(), block_size=32, max_blocks_per_worker=10_000, topic="",
                   prediction_ttl_s=60.0, metrics_registry=None, ask_server_info=False)
    for w, bs in block_sizes.items():
        kv.index.add_worker(w)
        kv.index.set_block_size(w, bs)
    return kv


async def test_prompt_hashes_cover_all_but_the_last_token() -> None:
    p = Prompt(list(range(64)), None)
    assert len(p.hashes(32)) == 1  # 64 tokens = 2 full blocks, but the last token is never reusable
    assert len(Prompt(list(range(65)), None).hashes(32)) == 2


async def test_predicted_hashes_are_what_token_based_overlap_finds() -> None:
    kv = routing({"a": 32, "b": 32})
    tokens = list(range(1000, 1000 + 300))
    kv.predict("a", Prompt(tokens, None))
    assert kv.index.overlap(tokens, workers=["a", "b"]) == {"a": 9}
    assert kv.overlap(Prompt(tokens + [5, 6], None), ["a", "b"]) == {"a": 9}


async def test_mixed_block_sizes_fall_back_to_per_size_lookups() -> None:
    kv = routing({"a": 32, "b": 16})
    tokens = list(range(200))
    kv.predict("a", Prompt(tokens, None))
    kv.predict("b", Prompt(tokens, None))
    assert kv.overlap(Prompt(tokens, None), ["a", "b"]) == {"a": 6, "b": 12}


async def test_salted_prompts_hash_apart() -> None:
    kv = routing({"a": 32})
    tokens = list(range(100))
    kv.predict("a", Prompt(tokens, "tenant-1"))
    assert kv.overlap(Prompt(tokens, "tenant-2"), ["a"]) == {}
    assert kv.overlap(Prompt(tokens, "tenant-1"), ["a"]) == {"a": 3}


def test_index_predict_hashes_equals_predict() -> None:
    from kvindex.hashing import block_hashes

    tokens = list(range(500))
    i1, i2 = KvIndex(32), KvIndex(32)
    for i in (i1, i2):
        i.add_worker("w")
    i1.predict("w", tokens, 60.0)
    i2.predict_hashes("w", block_hashes(tokens[:-1], 32), 60.0)
    assert i1.overlap(tokens) == i2.overlap(tokens) == {"w": 15}
    assert i1.block_sizes() == [32]


def stored(worker: str, kv: KvRouting, tokens: list[int], n_blocks: int, bs: int = 32) -> None:
    """The worker's own event: it stores the first `n_blocks` blocks of `tokens`."""
    from array import array

    from kvindex.events import BlockStored, DecodedBatch

    ev = BlockStored(list(range(1, n_blocks + 1)), None, array("I", tokens[:n_blocks * bs]), bs)
    kv.index.apply_batch(worker, DecodedBatch(events=[ev], raw_event_count=1))


async def test_credit_tells_confirmed_blocks_from_predicted_ones() -> None:
    kv = routing({"a": 32, "b": 32})
    tokens = list(range(5000, 5000 + 300))
    stored("a", kv, tokens, 3)
    kv.predict("a", Prompt(tokens, None))  # the picker sent the whole prompt there: 9 blocks credited
    kv.predict("b", Prompt(tokens[:100], None))  # only predictions on b
    credit = kv.credit(Prompt(tokens, None), ["a", "b"])
    assert (credit["a"].confirmed, credit["a"].predicted) == (3, 6)
    assert (credit["b"].confirmed, credit["b"].predicted) == (0, 3)
    assert {w: c.blocks for w, c in credit.items()} == kv.overlap(Prompt(tokens, None), ["a", "b"])


async def test_confirmed_only_overlap_ignores_predictions() -> None:
    kv = routing({"a": 32})
    tokens = list(range(300))
    kv.predict("a", Prompt(tokens, None))
    assert kv.overlap(Prompt(tokens, None), ["a"], predicted=False) == {}
    assert kv.overlap(Prompt(tokens, None), ["a"]) == {"a": 9}
