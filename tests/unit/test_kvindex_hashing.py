"""Chained block hashing: the request side and the event side must agree by construction."""

from __future__ import annotations

import struct
from array import array

import pytest
import xxhash

from kvindex.hashing import block_hashes, pack_tokens, root_seed


def test_first_block_is_xxh3_of_little_endian_u32_tokens_seeded_1337():
    toks = list(range(100, 104))
    assert block_hashes(toks, 4) == [xxhash.xxh3_64_intdigest(struct.pack("<4I", *toks), 1337)]


def test_each_block_is_seeded_with_its_parents_hash():
    toks = list(range(8))
    h0 = xxhash.xxh3_64_intdigest(struct.pack("<4I", *toks[:4]), 1337)
    h1 = xxhash.xxh3_64_intdigest(struct.pack("<4I", *toks[4:]), h0)
    assert block_hashes(toks, 4) == [h0, h1]


def test_partial_tail_block_is_ignored():
    assert len(block_hashes(list(range(11)), 4)) == 2


def test_prompt_shorter_than_a_block_has_no_hashes():
    assert block_hashes([1, 2, 3], 4) == []


def test_same_block_after_different_prefixes_hashes_differently():
    a = block_hashes([1, 2, 9, 9], 2)
    b = block_hashes([3, 4, 9, 9], 2)
    assert a[1] != b[1]


def test_lora_and_salt_terms_are_added_to_the_root_seed_with_wraparound():
    expected = (1337 + xxhash.xxh3_64_intdigest(b"ad", 0) + xxhash.xxh3_64_intdigest(b"s", 1)) % (1 << 64)
    assert root_seed("ad", "s") == expected


def test_lora_name_changes_every_hash_of_the_chain():
    plain = block_hashes(list(range(8)), 4)
    lora = block_hashes(list(range(8)), 4, lora_name="adapter")
    assert all(p != q for p, q in zip(plain, lora, strict=True))


def test_packed_array_input_gives_the_same_hashes_as_a_list():
    toks = list(range(64))
    assert block_hashes(array("I", toks), 16) == block_hashes(toks, 16)


def test_a_list_a_tuple_and_a_range_pack_to_the_same_u32s_and_bad_ids_are_refused():
    toks = [0, 1, 31999, 2**32 - 1]
    assert pack_tokens(toks).tobytes() == pack_tokens(tuple(toks)).tobytes() == struct.pack("<4I", *toks)
    assert pack_tokens(range(3)).tolist() == [0, 1, 2]
    for bad, err in (([1, -1], OverflowError), ([1, 2**32], OverflowError), ([1, 1.5], TypeError)):
        with pytest.raises(err):
            pack_tokens(bad)
