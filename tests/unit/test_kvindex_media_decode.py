"""Decoding every engine's multimodal block keys, and indexing them exactly: TensorRT-LLM samples built from its
source (NVIDIA/TensorRT-LLM commit 2bb816c6ee6c9e2a5e00f62cd36228eb8fe479aa), vLLM's from vLLM's own code
(tests/fixtures/make_vllm_mm_events.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from epp_extproc.dev.kvwire import pack_batch, stored_event
from kvindex.decode import decode_payload
from kvindex.events import BlockStored
from kvindex.hashing import DIALECT_TRTLLM, DIALECT_VLLM, DIALECT_VLLM_BARE, block_hashes
from kvindex.index import KvIndex

FIX = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_mm_events.json").read_text())
BS = 4
VOCAB = 151_936  # Qwen2.5-VL's vocabulary size


def trtllm_block_keys(items: list[tuple[bytes, int, int]], start: int, end: int) -> list[tuple[bytes, int]]:
    """TensorRT-LLM's per-block multimodal keys, after cpp/tensorrt_llm/batch_manager/blockKey.cpp
    `generateBlockHashExtraKeys`: each item (32-byte hash, start position, length) overlapping [start, end)
    gives (hash, where the block starts inside the item: 0 when the item starts inside the block)."""
    return [(h, 0 if pos >= start else start - pos) for h, pos, n in items if end > pos and start < pos + n]


def trtllm_tokens(prefix: list[int], items: list[tuple[bytes, int, int]], total: int) -> list[int]:
    """Token ids as TensorRT-LLM's events carry them for a prompt with media: an item's first token stands for its
    digest and the later ones are `vocab_size + offset` (engine-internal ids a render never produces)."""
    toks = list(prefix)
    for h, pos, n in items:
        assert len(toks) == pos
        toks += [int.from_bytes(h[:4], "little") & 0x7FFFFFFF] + [VOCAB + k for k in range(1, n)]
    return toks + list(range(9000, 9000 + total - len(toks)))


def trtllm_event(items: list[tuple[bytes, int, int]], *, v1: bool = False, uuid: str | None = None,
                 hashes: list[int] | None = None, prefix: tuple[int, ...] | list[int] = (1, 2, 3, 4, 5)) -> dict:
    toks = trtllm_tokens(list(prefix), items, 16)
    n = len(toks) // BS
    mm = []
    for b in range(n):
        keys = trtllm_block_keys(items, b * BS, (b + 1) * BS)
        mm.append([{**({"type": "mm_key"} if v1 else {}), "hash": h.hex(), "start_offset": off,
                    **({"uuid": uuid} if uuid else {})} for h, off in keys] or None)
    return stored_event(hashes or list(range(100, 100 + n)), None, toks, BS, mm_keys=mm)


IMG_A, IMG_B = bytes(range(32)), bytes(range(1, 33))


def one(ev: dict) -> BlockStored:
    batch = decode_payload(pack_batch([ev]))
    assert len(batch.events) == 1, batch.counters
    return batch.events[0]


def indexed(*events: dict, worker: str = "w") -> KvIndex:
    idx = KvIndex(BS)
    for ev in events:
        idx.apply_batch(worker, decode_payload(pack_batch([ev])))
    return idx


def test_trtllm_native_v2_keys_are_decoded_per_block_as_a_media_chain() -> None:
    ev = one(trtllm_event([(IMG_A, 5, 6)]))
    assert ev.mm_dialect == DIALECT_TRTLLM
    assert [k is not None for k in ev.mm] == [False, True, True, False]  # the item covers tokens 5..10


def test_trtllm_v1_serializer_keys_are_counted_apart_from_v2() -> None:
    b1 = decode_payload(pack_batch([trtllm_event([(IMG_A, 5, 6)], v1=True)]))
    b2 = decode_payload(pack_batch([trtllm_event([(IMG_A, 5, 6)])]))
    assert (b1.counters.mm_blocks_trtllm_v1, b1.counters.mm_blocks_trtllm_v2) == (2, 0)
    assert (b2.counters.mm_blocks_trtllm_v1, b2.counters.mm_blocks_trtllm_v2) == (0, 2)


def shared_blocks(ev1: dict, ev2: dict) -> int:
    """Blocks two workers' events key alike (both stored 4 blocks): 4 + 4 - distinct keys in the index."""
    idx = KvIndex(BS)
    idx.apply_batch("w1", decode_payload(pack_batch([ev1])))
    idx.apply_batch("w2", decode_payload(pack_batch([ev2])))
    return 8 - idx.unique_blocks()


def test_trtllm_same_image_same_place_keys_the_same_blocks() -> None:
    assert shared_blocks(trtllm_event([(IMG_A, 5, 6)]), trtllm_event([(IMG_A, 5, 6)], hashes=[7, 8, 9, 10])) == 4


def test_trtllm_another_image_at_the_same_place_keys_other_blocks_even_with_equal_token_ids() -> None:
    ev_a, ev_b = trtllm_event([(IMG_A, 5, 6)]), trtllm_event([(IMG_A, 5, 6)])
    ev_b["mm_keys"] = trtllm_event([(IMG_B, 5, 6)])["mm_keys"]  # same token ids, only the keys differ
    assert shared_blocks(ev_a, ev_b) == 1  # the first block (text) only


def test_trtllm_same_image_elsewhere_keys_other_blocks() -> None:
    ev_a = trtllm_event([(IMG_A, 5, 6)])
    ev_b = trtllm_event([(IMG_A, 4, 7)], prefix=[1, 2, 3, 4])  # the same image one token earlier
    assert ev_b["mm_keys"][1] == ev_a["mm_keys"][1]  # TensorRT-LLM: 0 for an item starting inside the block
    # ... so that block is told apart by its token ids (where the digest token sits), the next ones by offsets
    assert shared_blocks(ev_a, ev_b) == 1


def test_trtllm_uuid_is_part_of_the_key_where_the_engine_sends_one() -> None:
    assert shared_blocks(trtllm_event([(IMG_A, 5, 6)], uuid="u1"), trtllm_event([(IMG_A, 5, 6)], uuid="u2")) == 1


def test_trtllm_media_blocks_never_credit_a_text_only_chain_with_the_same_token_ids() -> None:
    ev = trtllm_event([(IMG_A, 5, 6)])
    idx = indexed(ev)
    assert idx.overlap(ev["token_ids"] + [0]) == {"w": 1}  # the text block only
    plain = dict(ev, mm_keys=None)
    assert indexed(plain).overlap(ev["token_ids"] + [0]) == {"w": 4}  # the same tokens as a text chain: all


def test_vllm_032_pairs_decode_with_their_offsets() -> None:
    p = FIX["scenarios"]["image_a_after_text"]["payloads"]
    batch = decode_payload(bytes.fromhex(p[DIALECT_VLLM][1]))
    (ev,) = batch.events
    assert ev.mm_dialect == DIALECT_VLLM and batch.counters.mm_blocks_vllm == 2


def test_older_vllm_bare_identifiers_decode_as_their_own_dialect() -> None:
    p = FIX["scenarios"]["image_a_after_text"]["payloads"]
    batch = decode_payload(bytes.fromhex(p[DIALECT_VLLM_BARE][1]))
    (ev,) = batch.events
    assert ev.mm_dialect == DIALECT_VLLM_BARE and batch.counters.mm_blocks_vllm_bare == 2


def test_vllm_salt_and_an_item_in_the_first_block_are_both_read() -> None:
    ev = one(stored_event([1, 2], None, list(range(8)), BS, extra_keys=[[["img", 1], "tenant-a"], [["img", -3]]]))
    assert ev.salt == "tenant-a" and all(k is not None for k in ev.mm)


def test_older_vllm_lone_string_on_the_root_block_stays_the_salt() -> None:
    ev = one(stored_event([1, 2], None, list(range(8)), BS, extra_keys=[["tenant-a"], None]))
    assert (ev.salt, ev.mm) == ("tenant-a", None)


def test_a_text_only_event_keeps_the_fast_path() -> None:
    ev = one(stored_event([1, 2], None, list(range(8)), BS))
    assert ev.mm is None and ev.mm_dialect is None


@pytest.mark.parametrize("mm_keys", [
    [[{"type": "mm_key", "hash": "00", "start_offset": 0}]],  # one entry for two blocks
    [[{"type": "image", "hash": "00", "start_offset": 0}], None],  # a tag no engine sends
    [[("00",)], None],  # an array too short to be a key
])
def test_media_keys_in_a_shape_no_engine_sends_are_skipped_and_counted(mm_keys) -> None:
    batch = decode_payload(pack_batch([stored_event([1, 2], None, list(range(8)), BS, mm_keys=mm_keys)]))
    assert batch.events == [] and batch.counters.skipped_mm_shape == 1


@pytest.mark.parametrize("key", [{"hash": "zz", "start_offset": 0}, {"hash": "00", "start_offset": "0"},
                                 {"hash": 5, "start_offset": 0}, {"hash": "00" * 300, "start_offset": 0}])
def test_malformed_media_keys_are_garbage_not_a_crash(key) -> None:
    batch = decode_payload(pack_batch([stored_event([1, 2], None, list(range(8)), BS, mm_keys=[[key], None])]))
    assert batch.events == [] and batch.counters.garbage_events == 1


def test_mixing_vllm_pairs_and_trtllm_keys_in_one_event_is_skipped_not_guessed() -> None:
    ev = stored_event([1, 2], None, list(range(8)), BS, extra_keys=[[["img", 0]], None],
                      mm_keys=[[{"hash": "00", "start_offset": 0}], None])
    assert decode_payload(pack_batch([ev])).counters.skipped_mm_shape == 1


def test_media_blocks_are_counted_per_dialect_in_the_metrics() -> None:
    reg = CollectorRegistry()
    idx = KvIndex(BS, registry=reg)
    idx.apply_batch("w", decode_payload(pack_batch([trtllm_event([(IMG_A, 5, 6)])])))
    idx.apply_batch("w", decode_payload(pack_batch([stored_event([1, 2], None, [0] * 8, BS, mm_keys=[[{}]])])))
    get = reg.get_sample_value
    assert get("epp_kv_mm_blocks_total", {"worker": "w", "dialect": "trtllm-v2"}) == 2
    assert get("epp_kv_mm_blocks_total", {"worker": "w", "dialect": "vllm"}) == 0
    assert get("epp_kv_events_skipped_total", {"worker": "w", "reason": "mm_shape"}) == 1


def test_text_only_events_index_exactly_as_before() -> None:
    toks = list(range(16))
    idx = indexed(stored_event([1, 2, 3, 4], None, toks, BS))
    assert idx.overlap_hashes(block_hashes(toks, BS), BS) == {"w": 4}
