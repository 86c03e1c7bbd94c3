"""Decoding every wire variant of KV-event batches; garbage never raises."""

from __future__ import annotations

import struct

import msgpack
import pytest

from epp_extproc.dev.kvwire import cleared_event, pack_all_int64, pack_batch, removed_event, stored_event
from kvindex.decode import (
    REPLAY_END_SEQ,
    decode_payload,
    encode_seq,
    split_live_frames,
    split_replay_frames,
)
from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored

TOKS = list(range(1, 9))  # two blocks of 4


def _i64(v: int) -> bytes:
    return b"\xd3" + struct.pack(">q", v)


def _s(text: str) -> bytes:
    b = text.encode()
    return bytes([0xA0 | len(b)]) + b


def _hand_built_int64_batch() -> bytes:
    """[ts, [BlockStored{...}], rank] written byte by byte the way the C++ serializer does."""
    ev = (
        b"\x88"  # map, 8 entries
        + _s("type") + _s("BlockStored")
        + _s("block_hashes") + b"\x92" + _i64(-2) + _i64(7)
        + _s("parent_block_hash") + b"\xc0"
        + _s("token_ids") + b"\x98" + b"".join(_i64(t) for t in TOKS)
        + _s("block_size") + _i64(4)
        + _s("lora_id") + b"\xc0"
        + _s("medium") + _s("GPU")
        + _s("lora_name") + b"\xc0"
    )
    return b"\x93" + b"\xcb" + struct.pack(">d", 1.5) + b"\x91" + ev + _i64(0)


def test_hand_built_all_int64_trt_batch_decodes_to_a_block_stored():
    batch = decode_payload(_hand_built_int64_batch())
    assert not batch.garbage
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [(1 << 64) - 2, 7]
    assert list(ev.token_ids) == TOKS and ev.block_size == 4 and ev.parent_block_hash is None
    assert batch.ts == 1.5 and batch.dp_rank == 0


def test_int64_encoder_matches_the_hand_built_bytes():
    ev = stored_event([-2, 7], None, TOKS, 4)
    assert pack_all_int64([1.5, [ev], 0]) == _hand_built_int64_batch()


def test_compact_and_all_int64_encodings_decode_to_equal_events():
    ev = stored_event([(1 << 64) - 2, 7], 12345, TOKS, 4, lora_name="ad", lora_id=3)
    compact = decode_payload(pack_batch([ev], ts=2.0))
    wide = decode_payload(pack_batch([ev], ts=2.0, all_int64=True))
    assert compact.events == wide.events


def test_compact_encoding_uses_small_ints():
    payload = pack_batch([stored_event([7], None, [1, 2], 2)], ts=1.0)
    assert b"\xd3" not in payload


def test_signed_and_unsigned_hashes_normalise_to_the_same_u64():
    a = decode_payload(pack_batch([stored_event([-1], -3, [1, 2], 2)]))
    b = decode_payload(pack_batch([stored_event([(1 << 64) - 1], (1 << 64) - 3, [1, 2], 2)]))
    assert a.events == b.events


def test_vllm_positional_array_events_decode():
    stored = ["BlockStored", [5, 6], None, TOKS, 4, None, "GPU", None]
    removed = ["BlockRemoved", [5], "GPU"]
    batch = decode_payload(msgpack.packb([1.0, [stored, removed, ["AllBlocksCleared"]]]))
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events[0].block_hashes == [5, 6]
    assert batch.dp_rank is None


def test_map_envelope_decodes_with_its_rank():
    payload = msgpack.packb({"ts": 1.0, "events": [cleared_event()], "data_parallel_rank": 2})
    batch = decode_payload(payload)
    assert batch.dp_rank == 2 and isinstance(batch.events[0], AllBlocksCleared)


def test_two_element_envelope_decodes_without_rank():
    batch = decode_payload(pack_batch([cleared_event()], envelope="array2"))
    assert batch.dp_rank is None and len(batch.events) == 1


def test_empty_event_list_is_a_heartbeat():
    assert decode_payload(pack_batch([])).heartbeat


def test_batch_with_only_skipped_events_is_not_a_heartbeat():
    batch = decode_payload(pack_batch([stored_event([1], None, [], 0, medium="CPU")]))  # a vLLM placeholder
    assert not batch.heartbeat and batch.events == []


def test_optional_keys_are_tolerated():
    ev = stored_event([1, 2], None, TOKS, 4, group_idx=0, locality="local", kv_cache_spec_kind="full")
    batch = decode_payload(pack_batch([ev]))
    assert len(batch.events) == 1 and batch.counters.unknown_keys == 0


def test_unknown_keys_are_ignored_and_counted():
    batch = decode_payload(pack_batch([stored_event([1, 2], None, TOKS, 4, shiny=1, new=2)]))
    assert len(batch.events) == 1 and batch.counters.unknown_keys == 2


def test_unknown_event_type_is_ignored_and_counted():
    batch = decode_payload(pack_batch([{"type": "BlockPromoted", "x": 1}, cleared_event()]))
    assert len(batch.events) == 1 and batch.counters.unknown_events == 1


def test_token_count_not_matching_block_size_times_hashes_is_skipped():
    batch = decode_payload(pack_batch([stored_event([1, 2], None, TOKS[:7], 4)]))
    assert batch.events == [] and batch.counters.skipped_length == 1


@pytest.mark.parametrize(("medium", "tier"), [("CPU", "cpu"), ("DISK", "disk"), ("Disk", "disk")])
def test_non_gpu_medium_is_decoded_with_its_tier(medium, tier):
    # issue 44: non-GPU stores were skipped (`skipped_medium`); they are indexed under their tier now
    batch = decode_payload(pack_batch([stored_event([1, 2], None, TOKS, 4, medium=medium),
                                       removed_event([1], medium=medium)]))
    assert [ev.tier for ev in batch.events] == [tier, tier] and batch.counters.skipped_medium == 0


def test_vllm_placeholder_offload_event_is_skipped_as_placeholder_not_garbage():
    batch = decode_payload(pack_batch([stored_event([7], None, [], 0, medium="CPU")]))
    assert batch.events == [] and (batch.counters.skipped_placeholder, batch.counters.garbage_events) == (1, 0)


def test_gpu_event_with_block_size_zero_is_still_garbage():
    batch = decode_payload(pack_batch([stored_event([7], None, [], 0)]))
    assert batch.counters.garbage_events == 1


def test_nil_medium_counts_as_gpu():
    assert len(decode_payload(pack_batch([stored_event([1, 2], None, TOKS, 4, medium=None)])).events) == 1


def test_non_main_group_is_skipped():
    batch = decode_payload(pack_batch([removed_event([1], group_idx=1)]))
    assert batch.events == [] and batch.counters.skipped_group == 1


def test_multimodal_keys_not_one_entry_per_block_are_skipped_not_guessed():
    # tokens alone do not identify a media block; keys we cannot place per block must not be indexed either
    # (decoded media keys: tests/unit/test_kvindex_media_decode.py)
    batch = decode_payload(pack_batch([stored_event([1, 2], None, TOKS, 4, mm_keys=[[b"img", 0]])]))
    assert batch.events == [] and batch.counters.skipped_mm_shape == 1


def test_one_bad_event_does_not_drop_its_neighbours():
    bad = stored_event([1, 2], None, ["a"] * 8, 4)
    batch = decode_payload(pack_batch([bad, cleared_event()]))
    assert len(batch.events) == 1 and batch.counters.garbage_events == 1


def test_token_id_outside_u32_is_a_garbage_event():
    batch = decode_payload(pack_batch([stored_event([1], None, [-1, 2], 2)]))
    assert batch.events == [] and batch.counters.garbage_events == 1


def test_absurd_number_of_hashes_is_a_garbage_event():
    payload = pack_batch([stored_event([0] * 1_000_001, None, [], 1)])
    batch = decode_payload(payload)
    assert batch.events == [] and batch.counters.garbage_events == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x93\xcb\x00",  # truncated
        b"\xc1",  # never-used msgpack byte
        msgpack.packb("hello"),
        msgpack.packb([1.0]),
        msgpack.packb([1.0, "not a list", 0]),
        msgpack.packb(["ts", [], 0]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, []]) + b"trailing",
        b"\x91" * 100_000,  # deeply nested
        b"\xdd\xff\xff\xff\xff",  # claims 4G elements
    ],
)
def test_garbage_payload_is_reported_not_raised(payload):
    assert decode_payload(payload).garbage


def test_events_that_are_not_maps_or_arrays_are_garbage_events():
    batch = decode_payload(msgpack.packb([1.0, [1, "x", None], 0]))
    assert batch.counters.garbage_events == 3 and not batch.garbage


def test_live_frames_split_into_topic_seq_payload():
    assert split_live_frames([b"kv", encode_seq(258), b"p"]) == (b"kv", 258, b"p")


@pytest.mark.parametrize("frames", [[b"", b"p"], [b"", b"\x00" * 7, b"p"], [b"", encode_seq(1), b"p", b"x"]])
def test_malformed_live_frames_are_rejected(frames):
    assert split_live_frames(frames) is None


def test_trtllm_replay_reply_with_topic_is_parsed():
    assert split_replay_frames([b"", b"kv", encode_seq(5), b"p"]) == (5, b"p")


def test_vllm_replay_reply_without_topic_is_parsed():
    assert split_replay_frames([b"", encode_seq(5), b"p"]) == (5, b"p")


@pytest.mark.parametrize(
    "frames", [[b"", b"", b"\xff" * 8, b""], [b"", b"\xff" * 8, b""]], ids=["trtllm", "vllm"]
)
def test_replay_end_marker_is_recognised(frames):
    assert split_replay_frames(frames) == (REPLAY_END_SEQ, b"")


# ---------------------------------------------------------------------------------------------------------------
# The engines' identity fields (issue 12): salts, LoRA, bigram pages, newer keys.

def _one(ev: dict | list) -> BlockStored:
    batch = decode_payload(pack_batch([ev]))
    assert batch.counters.garbage_events == 0 and batch.counters.skipped == 0, batch.counters
    (out,) = batch.events
    assert isinstance(out, BlockStored)
    return out


def test_vllm_salt_in_the_first_blocks_extra_keys_seeds_the_chain():
    ev = _one(stored_event([1, 2], None, TOKS, 4, extra_keys=[["tenant-a"], None]))
    assert (ev.salt, ev.lora_name) == ("tenant-a", None)


def test_vllm_typed_cache_salt_key_seeds_the_chain():
    ev = _one(stored_event([1, 2], None, TOKS, 4, extra_keys=[[{"type": "cache_salt", "salt": "t"}], None]))
    assert ev.salt == "t"


def test_sglang_typed_cache_salt_field_seeds_the_chain():
    assert _one(stored_event([1, 2], None, TOKS, 4, cache_salt="tenant-a")).salt == "tenant-a"


def test_salt_only_seeds_a_chain_that_starts_at_the_root():
    assert _one(stored_event([3], 2, TOKS[:4], 4, cache_salt="tenant-a")).salt is None


def test_vllm_lora_name_on_every_block_is_the_chains_adapter():
    ev = _one(stored_event([1, 2], None, TOKS, 4, lora_id=7, lora_name=None, extra_keys=[["ad"], ["ad"]]))
    assert (ev.lora_name, ev.salt) == ("ad", None)


def test_vllm_lora_and_salt_on_the_first_block_in_engine_order():
    ev = _one(stored_event([1, 2], None, TOKS, 4, lora_id=7, lora_name="ad", extra_keys=[["ad", "t"], ["ad"]]))
    assert (ev.lora_name, ev.salt) == ("ad", "t")


def test_lora_block_whose_adapter_name_is_unknown_is_skipped_not_indexed_as_the_base_model():
    batch = decode_payload(pack_batch([stored_event([1, 2], None, TOKS, 4, lora_id=7)]))
    assert batch.events == [] and batch.counters.skipped_extra_keys == 1


@pytest.mark.parametrize("keys", [[[b"\x01" * 32], None], [[{"type": "mm", "hash": "h"}], None]])
def test_typed_multimodal_and_prompt_embedding_extra_keys_are_skipped(keys):
    batch = decode_payload(pack_batch([stored_event([1, 2], None, TOKS, 4, extra_keys=keys)]))
    assert batch.events == [] and batch.counters.skipped_extra_keys == 1


def test_sglang_bigram_pages_decode_to_their_first_tokens():
    pairs = [[t, t + 1] for t in TOKS]
    ev = _one(stored_event([1, 2], None, pairs, 4))
    assert list(ev.token_ids) == TOKS


def test_newer_vllm_and_sglang_keys_are_known_not_counted_unknown():
    ev = stored_event([1, 2], None, TOKS, 4, ownership="o", session_id="s", kv_cache_spec_kind="full_attention",
                      event_version=1, locality="LOCAL")
    batch = decode_payload(pack_batch([ev, removed_event([1], ownership="o", locality="LOCAL")]))
    assert len(batch.events) == 2 and batch.counters.unknown_keys == 0


def test_positional_and_map_events_decode_through_one_field_order():
    from kvindex.decode import STORED_FIELDS

    m = stored_event([1, 2], None, TOKS, 4, lora_id=7, lora_name="ad", extra_keys=[["ad", "t"], ["ad"]],
                     group_idx=0)
    arr = ["BlockStored", *(m.get(f) for f in STORED_FIELDS)]
    assert _one(arr) == _one(m)


def test_a_batch_over_the_event_budget_is_refused_before_any_per_event_work():
    from kvindex.decode import TOO_MANY_EVENTS

    batch = decode_payload(pack_batch([removed_event([i]) for i in range(11)]), max_events=10)
    assert batch.garbage and batch.reason == TOO_MANY_EVENTS and batch.raw_event_count == 11
    assert batch.counters.garbage_events == 0 and batch.events == []


@pytest.mark.parametrize("n", [0, 3, 15, 16, 70_000])
@pytest.mark.parametrize("all_int64", [False, True])
def test_event_count_is_read_from_the_headers_alone(n, all_int64):
    from kvindex.decode import peek_event_count

    payload = pack_batch([cleared_event()] * n, all_int64=all_int64)
    assert peek_event_count(payload) == n
    assert peek_event_count(pack_batch([cleared_event()] * n, envelope="map")) is None
