"""The plane's wire (live messages, dumps, heartbeats) and the dump of a worker's slots, without NATS."""

from __future__ import annotations

import random

import pytest

from epp_extproc.dev.kvwire import pack_batch, removed_event, stored_event
from epp_extproc.kvplane.wire import (
    KIND_BATCH,
    KIND_CLEAR,
    DumpChunk,
    DumpSlot,
    Heartbeat,
    Malformed,
    Subjects,
    encode_dump_chunk,
    encode_heartbeat,
    encode_live,
    parse_dump_chunk,
    parse_heartbeat,
    parse_live,
    worker_token,
)
from kvindex.decode import decode_payload
from kvindex.dump import export_slots, load_slots, worker_block_size
from kvindex.index import KvIndex

BS = 4


def toks(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n * BS))


def feed(idx: KvIndex, worker: str) -> None:
    idx.apply_batch(worker, decode_payload(pack_batch([stored_event([11, 12, 13], None, toks(3), BS)])))
    idx.apply_batch(worker, decode_payload(pack_batch([stored_event([21, 22], 12, toks(2, 900), BS)])))
    idx.apply_batch(worker, decode_payload(pack_batch([stored_event([31], None, toks(1, 500), BS)], rank=1)))
    idx.apply_batch(worker, decode_payload(pack_batch([removed_event([13])])))


def copy_worker(src: KvIndex, dst: KvIndex, worker: str, max_pairs: int = 1000) -> int:
    bs, source, dialect = worker_block_size(src, worker)
    slots = [(r, b, e.tobytes(), o.tobytes()) for r, b, e, o in export_slots(src, worker, max_pairs)]
    return load_slots(dst, worker, bs, source, slots, dialect)


def test_a_loaded_dump_answers_lookups_like_the_index_fed_the_events():
    src, dst = KvIndex(BS), KvIndex(BS)
    feed(src, "w")
    copy_worker(src, dst, "w", max_pairs=1)  # one pair per piece: the pieces are joined back in order
    prompts = [toks(3), toks(2) + toks(2, 900), toks(1, 500) + [0], toks(4)]
    for p in prompts:
        assert dst.overlap(p, exclude_last_token=False) == src.overlap(p, exclude_last_token=False)
    assert dst.engine_hashes("w", 0) == src.engine_hashes("w", 0) and dst.engine_hashes("w", 1) == {31}
    assert dst.blocks_indexed("w") == src.blocks_indexed("w") == 5


def test_events_after_a_loaded_dump_chain_onto_its_blocks():
    src, dst = KvIndex(BS), KvIndex(BS)
    feed(src, "w")
    copy_worker(src, dst, "w")
    later = decode_payload(pack_batch([stored_event([14], 12, toks(1, 77), BS)]))
    src.apply_batch("w", later)
    dst.apply_batch("w", later)
    p = toks(2) + toks(1, 77)
    assert dst.overlap(p, exclude_last_token=False) == src.overlap(p, exclude_last_token=False) == {"w": 3}


def test_a_dump_loaded_above_the_cap_is_evicted_to_it():
    src, dst = KvIndex(BS), KvIndex(BS, max_blocks_per_worker=2)
    feed(src, "w")
    copy_worker(src, dst, "w")
    assert dst.blocks_indexed("w") <= 2


def test_a_dump_confirms_a_prediction_like_a_stored_event():
    src, dst = KvIndex(BS), KvIndex(BS)
    feed(src, "w")
    dst.predict("w", toks(3), ttl_s=60)
    copy_worker(src, dst, "w")
    assert dst.stats("w").predictions_confirmed >= 2


def test_live_message_round_trips_and_checks_every_field():
    data = encode_live(KIND_BATCH, 2, 7, 42, 99, "10.0.0.1:8000", b"payload")
    m = parse_live(data, 1024)
    assert m is not None and (m.kind, m.rank, m.epoch, m.seq, m.engine_seq, m.worker_id, m.payload) == (
        KIND_BATCH, 2, 7, 42, 99, "10.0.0.1:8000", b"payload")
    assert parse_live(encode_live(KIND_CLEAR, None, 7, 43, 0, "w"), 1024).rank is None
    assert parse_live(data, 3) is None  # payload over the budget
    assert parse_live(b"XXXX" + data[4:], 1024) is None
    assert parse_live(encode_live(KIND_CLEAR, None, 1, 1, 0, "w", b"x"), 1024) is None
    assert parse_live(encode_live(KIND_BATCH, None, 1, 1, 0, "w", b""), 1024) is None
    assert parse_live(data[:-len(b"payload") - 3], 1024) is None  # the worker id cut short


def test_random_bytes_never_raise_from_any_parser():
    rnd = random.Random(47)
    good = [encode_live(KIND_BATCH, 0, 1, 2, 3, "w", b"p"),
            encode_heartbeat(Heartbeat("r", 1, {"w": 3})),
            encode_dump_chunk(DumpChunk("w", 1, 2, 0, 1, 4, "events", [DumpSlot(0, 4, b"\0" * 8, b"\1" * 8)]))]
    for _ in range(3000):
        base = bytearray(rnd.choice(good))
        for _ in range(rnd.randint(1, 4)):
            base[rnd.randrange(len(base))] = rnd.randrange(256)
        data = bytes(base[:rnd.randint(0, len(base))])
        parse_live(data, 1 << 20)
        parse_heartbeat(data, 1 << 20)
        try:
            parse_dump_chunk(data, 1 << 20)
        except Malformed:
            pass


@pytest.mark.parametrize("mutate", [
    lambda d: d.__setitem__("slots", [[0, 4, b"\0" * 8, b"\0" * 16]]),  # arrays of different lengths
    lambda d: d.__setitem__("slots", [[0, 4, b"\0" * 7, b"\0" * 7]]),  # not whole u64s
    lambda d: d.__setitem__("i", 3),  # index past the count
    lambda d: d.__setitem__("bs", 0),
    lambda d: d.__setitem__("src", "guess"),
    lambda d: d.__setitem__("slots", [[-1, 4, b"", b""]]),
    lambda d: d.pop("e"),
    lambda d: d.__setitem__("es", {"0": 5}),  # engine seqs: a list of [rank, seq] pairs
    lambda d: d.__setitem__("es", [[0, -5]]),
    lambda d: d.__setitem__("es", [[-2, 5]]),
    lambda d: d.__setitem__("es", [[0, 5, 6]]),
    lambda d: d.__setitem__("fs", [[0, -1]]),  # first seqs: the same shape
    lambda d: d.__setitem__("fs", 3),
])
def test_a_malformed_dump_chunk_is_refused(mutate):
    import msgpack

    d = {"v": 1, "w": "w", "e": 1, "s": 2, "i": 0, "n": 1, "bs": 4, "src": "events", "d": None,
         "slots": [[0, 4, b"\0" * 8, b"\1" * 8]]}
    assert parse_dump_chunk(b"KVD1" + msgpack.packb(d), 1 << 20).seq == 2
    mutate(d)
    with pytest.raises(Malformed):
        parse_dump_chunk(b"KVD1" + msgpack.packb(d), 1 << 20)


def test_a_dump_chunk_says_where_its_state_stands_in_the_engines_numbering_per_rank():
    c = DumpChunk("w", 1, 2, 0, 1, 4, "events", [], engine_seqs={None: 7, 3: 1 << 40})
    assert parse_dump_chunk(encode_dump_chunk(c), 1 << 20).engine_seqs == {None: 7, 3: 1 << 40}


def test_a_dump_chunk_says_where_its_relays_history_begins_per_rank():
    c = DumpChunk("w", 1, 2, 0, 1, 4, "events", [], engine_seqs={None: 7}, first_seqs={None: 3, 2: 1 << 40})
    assert parse_dump_chunk(encode_dump_chunk(c), 1 << 20).first_seqs == {None: 3, 2: 1 << 40}


def test_a_dump_chunk_of_an_earlier_relay_without_engine_seqs_still_parses_with_none_known():
    import msgpack

    d = {"v": 1, "w": "w", "e": 1, "s": 2, "i": 0, "n": 1, "bs": 4, "src": "events", "d": None, "slots": []}
    c = parse_dump_chunk(b"KVD1" + msgpack.packb(d), 1 << 20)
    assert c.engine_seqs == {} and c.first_seqs is None  # (None: it does not say; {}: nothing since its start)
    assert parse_dump_chunk(encode_dump_chunk(DumpChunk("w", 1, 2, 0, 1, 4, "events", [], first_seqs={})),
                            1 << 20).first_seqs == {}


def test_worker_tokens_are_subject_safe_and_distinct():
    a, b = worker_token("10.0.0.1:8000"), worker_token("10_0_0_1:8000")
    assert a != b and "." not in a and ":" not in a
    assert Subjects("epp.kv", "pool-a").events("10.0.0.1:8000").startswith("epp.kv.pool-a.ev.")
    with pytest.raises(ValueError):
        Subjects("epp.kv", "bad.pool")


def test_a_heartbeat_says_goodbye_only_when_its_relay_stops():
    from epp_extproc.kvplane.wire import Heartbeat, encode_heartbeat, parse_heartbeat

    assert parse_heartbeat(encode_heartbeat(Heartbeat("r", 1, {"w": 3})), 1 << 20).bye is False
    assert parse_heartbeat(encode_heartbeat(Heartbeat("r", 1, {"w": 3}, bye=True)), 1 << 20).bye is True
