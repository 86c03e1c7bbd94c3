"""The local channel's byte layouts (epp_extproc/ingest/wire.py): what goes in comes out, bounds hold."""

from __future__ import annotations

from array import array

import pytest

from epp_extproc.ingest import wire


def test_a_lookup_round_trips_with_its_sections_and_filter() -> None:
    buf = wire.pack_lookup(7, 3, True, [(16, [1, 2, 2**64 - 1]), (32, [5])], ["a:1", "b:2"])
    req = wire.unpack_lookup(buf)
    assert (req.req_id, req.meta_version, req.predicted) == (7, 3, True)
    assert [(bs, list(h)) for bs, h in req.sections] == [(16, [1, 2, 2**64 - 1]), (32, [5])]
    assert req.workers == ["a:1", "b:2"]


def test_a_lookup_without_filter_means_every_worker() -> None:
    req = wire.unpack_lookup(wire.pack_lookup(1, 0, False, [(16, [1])]))
    assert req.workers is None and req.predicted is False


@pytest.mark.parametrize("buf", [b"", b"\x01\x00", wire.pack_lookup(1, 0, True, [(16, [1, 2])])[:-9],
                                 b"\x02" + wire.pack_lookup(1, 0, True, [])[1:]])
def test_a_malformed_lookup_is_refused(buf: bytes) -> None:
    with pytest.raises(ValueError):
        wire.unpack_lookup(buf)


def test_a_lookup_over_the_hash_bound_is_cut_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_LOOKUP_HASHES", 3)
    req = wire.unpack_lookup(wire.pack_lookup(1, 0, True, [(16, list(range(10)))]))
    assert list(req.sections[0][1]) == [0, 1, 2]


def test_an_answer_carries_meta_only_when_given() -> None:
    entries = array("I", [5, 0, 9])
    rid, version, meta, got = wire.unpack_answer(wire.pack_answer(4, 8, None, entries))
    assert (rid, version, meta, list(got)) == (4, 8, None, [5, 0, 9])
    raw = wire.encode_meta([("a:1", 16, True), ("", 0, False), ("b:2", 32, False)], [16, 32])
    _, _, meta, _ = wire.unpack_answer(wire.pack_answer(4, 8, raw, entries))
    m = wire.Meta.decode(8, meta)
    assert m.workers == ("a:1", "", "b:2")
    assert m.block_sizes == {"a:1": 16, "b:2": 32}
    assert m.warm == frozenset({"a:1"})
    assert m.sizes == (16, 32)


def test_a_prediction_round_trips_and_is_cut_to_the_bound() -> None:
    body = wire.pack_prediction("w:1", 16, 2.0, 123.5, [1, 2, 3])
    assert wire.unpack_prediction(body, 2)[:4] == ("w:1", 16, 2.0, 123.5)
    assert list(wire.unpack_prediction(body, 2)[4]) == [1, 2]


def test_control_frames_over_the_bound_are_refused() -> None:
    head = wire.frame(wire.T_HELLO, b"{}")[: wire.FRAME_HEADER]
    assert wire.frame_header(head) == (2, wire.T_HELLO)
    with pytest.raises(ValueError):
        wire.frame_header((wire.MAX_FRAME + 2).to_bytes(4, "little") + b"H")


def test_shards_split_workers_stably_and_use_every_shard() -> None:
    addresses = [f"10.0.0.{i}:8000" for i in range(64)]
    owners = [wire.shard_of(a, 4) for a in addresses]
    assert owners == [wire.shard_of(a, 4) for a in addresses]
    assert set(owners) == {0, 1, 2, 3}
    assert {wire.shard_of(a, 1) for a in addresses} == {0}


def test_the_workers_of_a_shared_store_share_its_shard_and_the_others_keep_theirs() -> None:
    members = [f"10.0.0.{i}:8000" for i in range(16)]
    stores = {**dict.fromkeys(members[:8], "pvc"), **dict.fromkeys(members[8:10], "nfs")}
    assert len({wire.shard_of(a, 4, stores) for a in members[:8]}) == 1
    assert len({wire.shard_of(a, 4, stores) for a in members[8:10]}) == 1
    assert [wire.shard_of(a, 4, stores) for a in members[10:]] == [wire.shard_of(a, 4) for a in members[10:]]
    assert wire.shard_of(members[0], 1, stores) == 0


def test_tier_runs_round_trip_and_a_cut_array_is_refused() -> None:
    runs = {0: ((1, 2), (8, 6)), 5: ((8, 3),), 9: ()}
    flat = wire.pack_tier_runs(runs)
    _, _, _, got = wire.unpack_answer(wire.pack_answer(1, 2, None, flat))
    assert wire.unpack_tier_runs(got) == runs
    for cut in (1, 3):
        with pytest.raises(ValueError):
            wire.unpack_tier_runs(flat[:-cut])


def test_a_tiers_lookup_says_so_and_the_meta_says_whether_a_shard_holds_tiers() -> None:
    assert wire.unpack_lookup(wire.pack_lookup(1, 0, False, [(16, [1])], tiers=True)).tiers
    assert not wire.unpack_lookup(wire.pack_lookup(1, 0, False, [(16, [1])])).tiers
    assert wire.Meta.decode(1, wire.encode_meta([("a:1", 16, True, None)], [16], True)).tiers
    assert not wire.Meta.decode(1, wire.encode_meta([("a:1", 16, True, None)], [16])).tiers


def test_a_truncated_answer_is_refused() -> None:
    with pytest.raises(ValueError):
        wire.unpack_answer(wire.pack_answer(4, 8, None, array("I", [5, 0, 9]))[:-2])
