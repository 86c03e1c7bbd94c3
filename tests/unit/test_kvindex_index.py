"""KvIndex semantics: chains, parents, removal, clearing, caps, block sizes, predictions, lookups."""

from __future__ import annotations

import logging
import tracemalloc

import numpy as np
import pytest

from epp_extproc.dev.kvwire import cleared_event, pack_batch, removed_event, stored_event
from kvindex.decode import decode_payload
from kvindex.hashing import block_hashes
from kvindex.index import KvIndex

BS = 4


def toks(n_blocks: int, start: int = 1, bs: int = BS) -> list[int]:
    return list(range(start, start + n_blocks * bs))


def batch(*events, rank=0):
    return decode_payload(pack_batch(list(events), rank=rank))


def store(idx, worker, engine_hashes, tokens, parent=None, bs=BS, rank=0, **kw):
    idx.apply_batch(worker, batch(stored_event(engine_hashes, parent, tokens, bs, **kw), rank=rank))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def idx():
    return KvIndex(default_block_size=BS)


def test_stored_chain_is_found_as_leading_blocks(idx):
    store(idx, "w", [11, 12, 13], toks(3))
    assert idx.overlap(toks(3), exclude_last_token=False) == {"w": 3}


def test_last_token_rule_lets_a_prompt_of_k_full_blocks_reuse_k_minus_1(idx):
    store(idx, "w", [11, 12, 13], toks(3))
    assert idx.overlap(toks(3)) == {"w": 2}


def test_prompt_longer_than_the_stored_chain_matches_the_chain(idx):
    store(idx, "w", [11, 12], toks(2))
    assert idx.overlap(toks(5)) == {"w": 2}


def test_diverging_prompt_stops_at_the_first_different_block(idx):
    store(idx, "w", [11, 12, 13], toks(3))
    prompt = toks(3)
    prompt[5] = 999  # inside block 1
    assert idx.overlap(prompt + [0]) == {"w": 1}


def test_workers_without_overlap_are_omitted(idx):
    store(idx, "a", [1], toks(1))
    store(idx, "b", [1], toks(1, start=50))
    assert idx.overlap(toks(1) + [0]) == {"a": 1}


def test_event_with_known_parent_continues_that_chain(idx):
    store(idx, "w", [11], toks(1))
    store(idx, "w", [12, 13], toks(3)[BS:], parent=11)
    assert idx.overlap(toks(3) + [0]) == {"w": 3}


def test_event_with_unknown_parent_is_skipped_and_counted(idx):
    store(idx, "w", [12], toks(2)[BS:], parent=999)
    assert idx.blocks_indexed("w") == 0
    assert idx.stats("w").skipped_unknown_parent == 1


def test_parent_given_as_signed_int_resolves_the_unsigned_engine_hash(idx):
    store(idx, "w", [(1 << 64) - 5], toks(1))
    store(idx, "w", [12], toks(2)[BS:], parent=-5)
    assert idx.overlap(toks(2) + [0]) == {"w": 2}


def test_block_removed_drops_the_block_and_stops_the_chain_there(idx):
    store(idx, "w", [11, 12, 13], toks(3))
    idx.apply_batch("w", batch(removed_event([12])))
    assert idx.overlap(toks(3) + [0]) == {"w": 1}


def test_removing_an_unknown_block_is_counted(idx):
    idx.apply_batch("w", batch(removed_event([77])))
    assert idx.stats("w").removed_unknown == 1


def test_removal_on_one_worker_keeps_the_block_for_another(idx):
    store(idx, "a", [1], toks(1))
    store(idx, "b", [2], toks(1))
    idx.apply_batch("a", batch(removed_event([1])))
    assert idx.overlap(toks(1) + [0]) == {"b": 1}


def test_two_engine_hashes_for_the_same_tokens_need_two_removals(idx):
    # e.g. salted blocks: engine hashes differ, token ids (hence our hash) are the same
    store(idx, "w", [1], toks(1))
    store(idx, "w", [2], toks(1))
    idx.apply_batch("w", batch(removed_event([1])))
    assert idx.overlap(toks(1) + [0]) == {"w": 1}
    idx.apply_batch("w", batch(removed_event([2])))
    assert idx.overlap(toks(1) + [0]) == {}


def test_all_blocks_cleared_empties_the_worker(idx):
    store(idx, "w", [11, 12], toks(2))
    idx.apply_batch("w", batch(cleared_event()))
    assert idx.overlap(toks(2) + [0]) == {} and idx.blocks_indexed("w") == 0


def test_clear_worker_keeps_other_workers(idx):
    store(idx, "a", [1], toks(1))
    store(idx, "b", [1], toks(1))
    idx.clear_worker("a")
    assert idx.overlap(toks(1) + [0]) == {"b": 1}
    assert "a" in idx.workers()


def test_drop_worker_forgets_it_and_its_slot_is_reused_cleanly(idx):
    store(idx, "a", [1], toks(1))
    idx.drop_worker("a")
    store(idx, "b", [2], toks(1, start=50))
    assert idx.workers() == ["b"]
    assert idx.overlap(toks(1) + [0]) == {}
    assert idx.unique_blocks() == 1


def test_lora_blocks_only_match_requests_for_that_lora(idx):
    store(idx, "w", [1], toks(1), lora_name="ad")
    assert idx.overlap(toks(1) + [0]) == {}
    assert idx.overlap(toks(1) + [0], lora_name="ad") == {"w": 1}


def test_salted_requests_do_not_match_unsalted_event_blocks(idx):
    store(idx, "w", [1], toks(1))
    assert idx.overlap(toks(1) + [0], salt="tenant") == {}


def test_workers_filter_restricts_the_answer(idx):
    store(idx, "a", [1], toks(1))
    store(idx, "b", [1], toks(1))
    assert idx.overlap(toks(1) + [0], workers=["b", "unknown"]) == {"b": 1}


def test_per_worker_cap_evicts_the_oldest_blocks_first():
    idx = KvIndex(default_block_size=BS, max_blocks_per_worker=3)
    for i in range(5):
        store(idx, "w", [100 + i], toks(1, start=10 * i + 1))
    assert idx.blocks_indexed("w") == 3
    assert idx.overlap(toks(1, start=1) + [0]) == {}
    assert idx.overlap(toks(1, start=41) + [0]) == {"w": 1}
    assert idx.stats("w").evicted == 2


def test_event_block_size_disagreeing_with_the_default_is_adopted_counted_and_not_warned(idx, caplog):
    with caplog.at_level(logging.INFO, logger="kvindex.index"):
        store(idx, "w", [1, 2], toks(2, bs=8), bs=8)
    assert idx.block_size("w") == 8
    assert idx.stats("w").block_size_mismatch == 1
    assert "block_size=8" in caplog.text and "WARNING" not in caplog.text
    assert idx.overlap(toks(2, bs=8) + [0]) == {"w": 2}


def test_a_second_block_size_is_indexed_under_its_own_size_and_never_wipes_the_worker(idx, caplog):
    # vLLM 0.33 hybrid models publish tail blocks in the hash block size next to the main size
    with caplog.at_level(logging.WARNING, logger="kvindex.index"):
        store(idx, "w", [1, 2], toks(2, bs=8), bs=8)
        store(idx, "w", [3], toks(1, bs=4), bs=4)
        store(idx, "w", [4], toks(1, bs=4)[::-1], bs=4)
    assert idx.engine_hashes("w") == {1, 2, 3, 4} and idx.stats("w").clears == 0
    assert idx.block_size("w") == 8
    assert idx.overlap(toks(2, bs=8) + [0]) == {"w": 2}
    assert caplog.text.count("besides its 8") == 1


def test_a_configured_block_size_keeps_entries_of_another_size(idx):
    store(idx, "w", [1], toks(1, bs=8), bs=8)
    idx.set_block_size("w", 4)
    assert idx.engine_hashes("w") == {1} and idx.block_size("w") == 4
    assert idx.overlap(toks(1, bs=8) + [0]) == {"w": 1}


def test_block_sizes_per_worker_are_bounded_and_the_excess_is_counted(idx):
    for bs in (1, 2, 3, 5, 6, 7):
        store(idx, "w", [bs], list(range(bs)), bs=bs)
    assert len(idx.snapshot()["workers"]["w"]["block_sizes"]) <= 4
    assert idx.stats("w").skipped_block_size == 2


def test_workers_with_different_block_sizes_are_each_matched_with_their_own(idx):
    store(idx, "small", [1, 2, 3, 4], toks(4, bs=4), bs=4)
    idx.set_block_size("big", 8)
    store(idx, "big", [1, 2], toks(2, bs=8), bs=8)
    assert idx.overlap(toks(4) + [0]) == {"small": 4, "big": 2}


def test_set_block_size_reports_back(idx):
    idx.set_block_size("w", 64)
    assert idx.block_size("w") == 64 and idx.block_size("other") == BS


def test_overlap_hashes_matches_overlap_for_precomputed_hashes(idx):
    store(idx, "w", [1, 2, 3], toks(3))
    assert idx.overlap_hashes(block_hashes(toks(3), BS), BS) == {"w": 3}


def test_overlap_hashes_ignores_workers_of_another_block_size(idx):
    store(idx, "w", [1, 2, 3], toks(3))
    assert idx.overlap_hashes(block_hashes(toks(3), 8), 8) == {}


def numbered(idx, hashes, bs=BS, workers=None, predicted=True):
    out = [0] * len(idx.worker_numbers())
    idx.overlap_numbered(hashes, bs, out, workers, predicted=predicted)
    # the shard's vectorised spread (an int64 array, issue 45) must fill the same figures as the loop
    arr = np.zeros(len(out), np.int64)
    idx.overlap_numbered(hashes, bs, arr, workers, predicted=predicted)
    assert arr.tolist() == out
    return {w: n for w, n in zip(idx.worker_numbers(), out, strict=True) if n}


def test_numbered_overlap_is_the_same_figure_as_overlap_hashes_in_a_dense_list(idx):
    import random

    rng = random.Random(3)
    for w in range(40):  # prefixes of one chain, holes, a second rank: what the walk has to get right
        k = rng.randint(0, 12)
        store(idx, f"w{w}", list(range(1, k + 1)), toks(k))
        if w % 7 == 0:
            store(idx, f"w{w}", [90, 91, 92, 93, 94], toks(5), rank=1)
        if w % 5 == 0 and k > 2:
            idx.apply_batch(f"w{w}", batch(removed_event([2])))
    idx.predict("w3", toks(9) + [0], ttl_s=30)
    hashes = block_hashes(toks(12), BS)
    for predicted in (True, False):
        for workers in (None, ["w1", "w3", "w14", "nobody"]):
            assert numbered(idx, hashes, workers=workers, predicted=predicted) == idx.overlap_hashes(
                hashes, BS, workers, predicted=predicted)


def test_a_dropped_workers_number_is_freed_and_the_lowest_free_one_is_reused(idx):
    for w in ("a", "b", "c"):
        store(idx, w, [1], toks(1))
    idx.drop_worker("b")
    assert idx.worker_numbers() == ["a", "", "c"]
    assert numbered(idx, block_hashes(toks(1), BS)) == {"a": 1, "c": 1}
    store(idx, "d", [1, 2], toks(2))
    assert idx.worker_numbers() == ["a", "d", "c"]
    assert numbered(idx, block_hashes(toks(2), BS)) == {"a": 1, "d": 2, "c": 1}


def test_each_dp_rank_is_indexed_separately_and_the_worker_gets_its_best_rank(idx):
    store(idx, "w", [1], toks(1), rank=0)
    store(idx, "w", [1, 2, 3], toks(3), rank=1)
    idx.apply_batch("w", batch(cleared_event(), rank=0))
    assert idx.overlap(toks(3) + [0]) == {"w": 3}
    assert idx.snapshot()["workers"]["w"]["ranks"] == {"0": {"blocks_indexed": 0}, "1": {"blocks_indexed": 3}}


def test_prediction_counts_like_a_real_block():
    idx = KvIndex(default_block_size=BS, clock=FakeClock())
    idx.predict("w", toks(3) + [0], ttl_s=5)
    assert idx.overlap(toks(3) + [0]) == {"w": 3}


def test_prediction_vanishes_after_its_ttl():
    clock = FakeClock()
    idx = KvIndex(default_block_size=BS, clock=clock)
    idx.predict("w", toks(3) + [0], ttl_s=5)
    clock.t += 5.1
    assert idx.overlap(toks(3) + [0]) == {}
    assert idx.stats("w").predictions_expired == 3


def test_confirmed_prediction_outlives_its_ttl():
    clock = FakeClock()
    idx = KvIndex(default_block_size=BS, clock=clock)
    idx.predict("w", toks(2) + [0], ttl_s=5)
    store(idx, "w", [1, 2], toks(2))
    clock.t += 10
    assert idx.overlap(toks(2) + [0]) == {"w": 2}
    assert idx.predicted_count("w") == 0 and idx.stats("w").predictions_confirmed == 2


def test_refreshed_prediction_survives_the_first_ttl():
    clock = FakeClock()
    idx = KvIndex(default_block_size=BS, clock=clock)
    idx.predict("w", toks(2) + [0], ttl_s=5)
    clock.t += 3
    idx.predict("w", toks(2) + [0], ttl_s=5)
    clock.t += 3
    assert idx.overlap(toks(2) + [0]) == {"w": 2}


def test_prediction_uses_the_last_token_rule():
    idx = KvIndex(default_block_size=BS, clock=FakeClock())
    idx.predict("w", toks(2), ttl_s=5)
    assert idx.predicted_count("w") == 1


def test_clear_worker_drops_predictions_too():
    idx = KvIndex(default_block_size=BS, clock=FakeClock())
    idx.predict("w", toks(2) + [0], ttl_s=5)
    idx.clear_worker("w")
    assert idx.overlap(toks(2) + [0]) == {}


def test_heartbeat_batch_is_counted_and_changes_nothing(idx):
    idx.apply_batch("w", batch())
    assert idx.stats("w").heartbeats == 1 and idx.blocks_indexed("w") == 0


def test_garbage_batch_is_counted(idx):
    idx.apply_batch("w", decode_payload(b"\xc1"))
    assert idx.stats("w").garbage_batches == 1


def test_decoder_skips_are_accumulated_per_worker(idx):
    idx.apply_batch("w", batch(stored_event([1], None, [], 0, medium="CPU"), {"type": "Nope"}))
    st = idx.stats("w")
    assert (st.skipped_placeholder, st.unknown_events) == (1, 1)


def test_lookup_stops_at_the_first_block_no_worker_holds(idx, monkeypatch):
    store(idx, "w", [1], toks(1))
    calls = []

    class Spy(dict):
        def get(self, k, d=None):
            calls.append(k)
            return super().get(k, d)

    monkeypatch.setattr(idx, "_blocks", [Spy(part) for part in idx._blocks])
    # the pure walk (a spy's `get` is what it calls); the C walk's early stop: test_kvindex_native_walk.py
    monkeypatch.setattr("kvindex.index._native_walk", None)
    idx.overlap(toks(100) + [0])
    assert len(calls) == 2


def test_snapshot_is_json_serialisable_and_reports_per_worker_state(idx):
    import json

    store(idx, "w", [1, 2], toks(2))
    snap = json.loads(json.dumps(idx.snapshot()))
    w = snap["workers"]["w"]
    assert (w["blocks_indexed"], w["block_size"], w["events_applied"]) == (2, BS, 1)


def test_memory_per_block_worker_entry_is_under_200_bytes():
    idx = KvIndex(default_block_size=BS)
    prompt = toks(256)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for w in range(16):
        store(idx, f"w{w}", [(w << 32) + i for i in range(256)], prompt)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert (after - before) / (16 * 256) <= 200


def test_payload_ranks_are_bounded_so_a_publisher_cannot_open_a_slot_per_rank():
    idx = KvIndex(default_block_size=BS, max_ranks_per_worker=4)
    store(idx, "w", [1], toks(1), rank=60_000)
    store(idx, "w", [2], toks(1), rank=3)
    assert idx.stats("w").skipped_rank == 1 and idx.engine_hashes("w") == {2}
    assert len(idx.snapshot()["workers"]["w"]["ranks"]) == 1


def test_the_block_cap_counts_the_whole_worker_over_its_ranks():
    idx = KvIndex(default_block_size=BS, max_blocks_per_worker=10)
    for rank in range(4):
        store(idx, "w", list(range(rank * 100, rank * 100 + 5)), toks(5), rank=rank)
    assert idx.blocks_indexed("w") <= 10 and idx.stats("w").evicted == 10


def test_salted_event_chains_match_salted_prompts_only(idx):
    store(idx, "w", [1, 2], toks(2), cache_salt="tenant-a")
    assert idx.overlap(toks(2) + [0], salt="tenant-a") == {"w": 2}
    assert idx.overlap(toks(2) + [0]) == {}


def test_predicted_unique_blocks_follow_predictions_through_confirm_expiry_and_clear():
    clock = FakeClock()
    idx = KvIndex(default_block_size=BS, clock=clock)
    predicted = lambda: idx.snapshot()["predicted_unique_blocks"]  # noqa: E731
    idx.predict("a", toks(4) + [0], ttl_s=5)
    idx.predict("b", toks(2) + [0], ttl_s=10)  # the same first two blocks: still 4 distinct hashes
    assert predicted() == 4
    store(idx, "a", [1], toks(1))  # a's first block confirmed; b still predicts it
    assert predicted() == 4
    clock.t += 6  # a's other three expire; b's two remain
    idx.overlap(toks(1))
    assert predicted() == 2
    idx.clear_worker("b")
    assert predicted() == 0
    assert idx.overlap(toks(4) + [0]) == {"a": 1}


def test_blocks_spread_over_the_parts_so_no_resize_moves_the_whole_index():
    from kvindex.index import PARTS

    idx = KvIndex(default_block_size=BS, max_blocks_per_worker=100_000)
    store(idx, "w", list(range(1, 6401)), toks(6400))
    sizes = [len(part) for part in idx._blocks]
    assert sum(sizes) == idx.unique_blocks() == 6400
    assert max(sizes) < 3 * 6400 / PARTS  # xxh3 spreads them: no part holds more than a few times its share
