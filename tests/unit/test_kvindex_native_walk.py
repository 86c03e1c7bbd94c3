"""The accelerator's lookup half (kvindex/_csrc/walk.h): the mask walk and its spread onto slots must equal the
pure paths (`KvIndex._walk_py`, `index._spread_py`) on any index, and refuse what is not an index's own
structure with a Python exception, never a crash."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvindex.index as kvindex_index
from kvindex import native
from kvindex.hashing import block_hashes
from kvindex.index import PART_MASK, KvIndex

_native = native.MODULE
pytestmark = pytest.mark.skipif(_native is None, reason="kvindex._native is not built or EPP_KVINDEX_PURE is set")
BS = 4


def random_parts(rng: random.Random, hashes: list[int], slots: int, held: float) -> list[dict[int, int]]:
    parts: list[dict[int, int]] = [{} for _ in range(PART_MASK + 1)]
    for h in hashes:
        if rng.random() < held:
            parts[h & PART_MASK][h] = rng.getrandbits(slots)
    return parts


class Maps:
    """The two fields `_walk_py` reads, without an index around them."""

    def __init__(self, blocks: list[dict[int, int]], pred: list[dict[int, int]] | None) -> None:
        self._blocks = blocks
        self._pred = pred if pred is not None else [{} for _ in blocks]
        self._n_pred = 0 if pred is None else 1


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32), n_blocks=st.integers(0, 40), slots=st.integers(1, 300),
       with_pred=st.booleans(), held=st.floats(0.5, 1.0))
def test_the_c_walk_and_spread_equal_the_pure_ones_on_any_masks(seed, n_blocks, slots, with_pred, held):
    rng = random.Random(seed)
    hashes = [rng.getrandbits(64) for _ in range(n_blocks)]
    blocks = random_parts(rng, hashes, slots, held)
    pred = random_parts(rng, hashes, slots, 0.3) if with_pred else None
    alive = rng.getrandbits(slots) | rng.getrandbits(slots)
    want = KvIndex._walk_py(Maps(blocks, pred), iter(hashes), alive, True)  # type: ignore[arg-type]
    got = _native.walk(iter(hashes), blocks, pred, alive, PART_MASK)
    assert got == want
    assert np.array_equal(np.frombuffer(_native.spread(got, slots), np.int64), kvindex_index._spread_py(want, slots))


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**32), n_blocks=st.integers(0, 40), slots=st.integers(1, 300),
       n_delta=st.integers(-70, 70), with_pred=st.booleans(), held=st.floats(0.3, 1.0))
def test_the_fused_walk_spread_is_the_pure_walk_then_spread(seed, n_blocks, slots, n_delta, with_pred, held):
    """dec45: `walk_spread` (one pass in C digits) equals `_spread_py(_walk_py(...))`, with slot counts below and
    above the masks' widths (bits at or past n ignored), predictions ORed in, and an `alive` of any width."""
    rng = random.Random(seed)
    hashes = [rng.getrandbits(64) for _ in range(n_blocks)]
    blocks = random_parts(rng, hashes, slots, held)
    pred = random_parts(rng, hashes, slots, 0.3) if with_pred else None
    alive = rng.choice([rng.getrandbits(slots) | rng.getrandbits(slots), (1 << slots) - 1, rng.getrandbits(slots), 0])
    n = max(0, slots + n_delta)
    drops = KvIndex._walk_py(Maps(blocks, pred), iter(hashes), alive, True)  # type: ignore[arg-type]
    # an index's masks never reach past its slots (n >= slots): the pure spread; past n, the C spread's rule
    want = kvindex_index._spread_py(drops, n) if n >= slots else np.frombuffer(_native.spread(drops, n), np.int64)
    got = np.frombuffer(_native.walk_spread(iter(hashes), blocks, pred, alive, PART_MASK, n), np.int64)
    assert got.tolist() == want.tolist()


def test_the_fused_walk_spread_refuses_what_is_not_an_index():
    parts: list[dict[int, int]] = [{} for _ in range(PART_MASK + 1)]
    for args, error in (((iter([1]), parts, None, -1, PART_MASK, 8), ValueError),
                        ((iter([1]), parts, None, 1, PART_MASK, -1), ValueError),
                        ((iter([1]), parts[:1], None, 1, PART_MASK, 8), ValueError),
                        ((iter([1]), parts, [{}], 1, PART_MASK, 8), TypeError),
                        ((iter(["x"]), parts, None, 1, PART_MASK, 8), TypeError)):
        with pytest.raises(error):
            _native.walk_spread(*args)
    bad = [{} for _ in range(PART_MASK + 1)]
    bad[1 & PART_MASK][1] = "mask"
    with pytest.raises(TypeError):
        _native.walk_spread(iter([1]), bad, None, 1, PART_MASK, 8)


def test_an_index_answers_the_same_through_either_walk(monkeypatch):
    idx = KvIndex(BS)
    toks = list(range(1, 33))
    for w in range(70):  # workers holding 1..8 leading blocks of one prompt, some a prediction more
        k = 1 + w % 8
        idx.apply_batch(f"w{w}", _stored_batch(list(range(w * 100, w * 100 + k)), toks[: k * BS]))
        if w % 3 == 0:
            idx.predict_hashes(f"w{w}", block_hashes(toks, BS)[: k + 1], ttl_s=60)
    hashes = block_hashes(toks, BS)
    workers = tuple(f"w{w}" for w in range(70))
    c = (idx.overlap_hashes(hashes, BS), idx.overlap_array(hashes, BS, workers).tolist())
    monkeypatch.setattr(kvindex_index, "_native_walk", None)
    monkeypatch.setattr(kvindex_index, "_native_spread", None)
    monkeypatch.setattr(kvindex_index, "_native_walk_spread", None)
    assert (idx.overlap_hashes(hashes, BS), idx.overlap_array(hashes, BS, workers).tolist()) == c
    assert c[0]["w7"] == 8 and c[0]["w3"] == 5  # w3 holds 4 blocks and a prediction of the fifth


def test_the_walk_stops_pulling_hashes_when_no_slot_is_left():
    blocks: list[dict[int, int]] = [{} for _ in range(PART_MASK + 1)]
    blocks[1 & PART_MASK][1] = 0b1
    pulled = []

    def chain():
        for h in (1, 2, 3, 4):
            pulled.append(h)
            yield h

    assert _native.walk(chain(), blocks, None, 0b1, PART_MASK) == [(1, 0b1)]  # one block held, then none
    assert pulled == [1, 2]  # the tail of a lazily hashed prompt is never hashed


@pytest.mark.parametrize(("args", "error"), [
    ((["x"], [{}] * (PART_MASK + 1), None, 1, PART_MASK), TypeError),  # a hash that is not an int
    (([1], [{}] * PART_MASK, None, 1, PART_MASK), ValueError),  # fewer parts than the mask reaches
    (([1], [[]] * (PART_MASK + 1), None, 1, PART_MASK), TypeError),  # parts that are not dicts
    (([1], [{}] * (PART_MASK + 1), [{}], 1, PART_MASK), TypeError),  # pred of another length
    (([1], [{}] * (PART_MASK + 1), None, "1", PART_MASK), TypeError),  # alive not an int
    ((5, [{}] * (PART_MASK + 1), None, 1, PART_MASK), TypeError),  # hashes not iterable
])
def test_the_c_walk_refuses_what_is_not_an_index(args, error):
    with pytest.raises(error):
        _native.walk(*args)


def test_a_mask_of_another_type_inside_the_index_is_an_error_not_a_crash():
    blocks: list[dict[int, int]] = [{} for _ in range(PART_MASK + 1)]
    blocks[7 & PART_MASK][7] = "not a mask"  # type: ignore[assignment]
    with pytest.raises(TypeError):
        _native.walk([7], blocks, None, 0b11, PART_MASK)


@pytest.mark.parametrize(("drops", "error"), [
    ([(1, -1)], ValueError), ([(-1, 1)], ValueError), ([(1,)], TypeError), ([("1", 1)], TypeError), ([5], TypeError),
])
def test_the_c_spread_refuses_bad_drops(drops, error):
    with pytest.raises(error):
        _native.spread(drops, 8)


def test_the_c_spread_ignores_bits_past_the_slots_and_takes_wide_masks():
    out = np.frombuffer(_native.spread([(3, (1 << 200) | 0b101), (9, 1 << 7)], 8), np.int64)
    assert out.tolist() == [3, 0, 3, 0, 0, 0, 0, 9]
    assert _native.spread([], 0) == b""


def _stored_batch(hashes: list[int], tokens: list[int]):
    from epp_extproc.dev.kvwire import pack_batch, stored_event
    from kvindex.decode import decode_payload

    return decode_payload(pack_batch([stored_event(hashes, None, tokens, BS)]))


def test_parts_shrunk_by_the_hash_iterator_are_an_error_not_a_read_past_the_list():
    blocks: list[dict[int, int]] = [{} for _ in range(PART_MASK + 1)]
    last = PART_MASK  # a hash that falls in the last part
    blocks[last][last] = 0b1

    def chain():
        yield last
        del blocks[1:]  # Python code the walk runs between two hashes
        yield last + PART_MASK + 1

    with pytest.raises(ValueError):
        _native.walk(chain(), blocks, None, 0b1, PART_MASK)
