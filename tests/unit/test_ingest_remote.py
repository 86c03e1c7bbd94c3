"""`RemoteKv` against a scripted shard on a real SEQPACKET socket: a late shard costs one bounded wait, its late
answer is never taken for the next request's, and a missing shard answers nothing at once."""

from __future__ import annotations

import socket
import tempfile
import threading
from array import array

import numpy as np

from epp_extproc.adapters.kv_remote import RemoteKv
from epp_extproc.core.contract import PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.ingest import wire

META = wire.encode_meta([("w:1", 4, True, None), ("v:2", 4, True, None)], [4])


def scripted_shard(path: str, answers: list[bool], done: threading.Event, meta: bytes = META) -> threading.Thread:
    """A shard that takes one connection per entry of `answers`: True answers its request (w:1 holds 2
    blocks, v:2 holds 1), False reads it and says nothing (a stalled shard)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(4)

    def run() -> None:
        conns = []
        for answer in answers:
            conn, _ = srv.accept()
            conns.append(conn)
            req = wire.unpack_lookup(conn.recv(1 << 20))
            if answer:
                conn.send(wire.pack_answer(req.req_id, 7, meta, array("I", [2, 1])))
        done.wait(10)
        for c in conns:
            c.close()
        srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def kv_at(directory: str, timeout_s: float) -> RemoteKv:
    return RemoteKv(EndpointRegistry(), directory=directory, shards=1, block_size=4, prediction_ttl_s=0.0,
                    lookup_timeout_s=timeout_s, ask_server_info=False)


def test_a_stalled_shard_costs_one_timeout_and_the_next_lookup_gets_its_own_answer() -> None:
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        t = scripted_shard(wire.lookup_socket(d, 0), [False, True], done)
        kv = kv_at(d, 0.2)
        prompt = kv.prompt(list(range(12)), PromptIdentity())
        assert kv.overlap(prompt, ["w:1", "v:2"]) == {}
        assert kv.counts["timeout"] == 1
        assert kv.overlap(prompt, ["w:1", "v:2"]) == {"w:1": 2, "v:2": 1}
        assert kv.counts["ok"] == 1
        done.set()
        t.join(5)


def test_the_answer_is_narrowed_to_the_candidates() -> None:
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        t = scripted_shard(wire.lookup_socket(d, 0), [True], done)
        kv = kv_at(d, 2.0)
        assert kv.overlap(kv.prompt(list(range(12)), PromptIdentity()), ["v:2"]) == {"v:2": 1}
        assert kv.block_size("w:1") == 4 and kv.warm("w:1")  # the worker table came with the answer
        done.set()
        t.join(5)


def test_no_shard_means_no_overlap_and_a_count() -> None:
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        kv = kv_at(d, 2.0)
        assert kv.overlap(kv.prompt(list(range(12)), PromptIdentity()), ["w:1"]) == {}
        assert kv.counts == {"ok": 0, "unavailable": 1, "timeout": 0}


def test_a_block_size_follows_the_worker_table_that_arrives_after_it_was_asked() -> None:
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        t = scripted_shard(wire.lookup_socket(d, 0), [True], done,
                           meta=wire.encode_meta([("w:1", 16, True, None), ("v:2", 4, True, None)], [4, 16]))
        kv = kv_at(d, 2.0)
        kv._registry.replace([Endpoint("w", "w:1"), Endpoint("v", "v:2")])
        assert kv.block_size("w:1") == 4  # nothing known yet: the default, asked by a decision
        kv.overlap(kv.prompt(list(range(40)), PromptIdentity()), ["w:1", "v:2"])
        assert kv.block_size("w:1") == 16  # the table the answer carried
        done.set()
        t.join(5)


def test_addresses_outside_the_pool_get_the_default_block_size_and_are_not_kept() -> None:
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        kv = kv_at(d, 2.0)
        for i in range(10_000):  # a peer's predictions may name any address
            assert kv.block_size(f"10.9.{i // 250}.{i % 250}:8000") == 4
        assert kv._size_of == {}


def answering_shard(path: str, done: threading.Event, counts: list[int], meta: bytes) -> threading.Thread:
    """A shard that answers every request of one connection with `counts` (one per row of `meta`)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        conn.settimeout(0.05)
        while not done.is_set():
            try:
                buf = conn.recv(1 << 20)
            except TimeoutError:
                continue
            if not buf:
                break
            req = wire.unpack_lookup(buf)
            conn.send(wire.pack_answer(req.req_id, 7, meta, array("I", counts)))
        conn.close()
        srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_overlap_array_is_the_overlap_dict_in_the_order_asked() -> None:
    """Issue 45: a columnar table takes the shard's answer as one array, gathered by each worker's row."""
    rows = [("w:1", 4, True, None), ("", 0, False, None), ("v:2", 8, True, None), ("u:3", 4, True, None)]
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        t = answering_shard(wire.lookup_socket(d, 0), done, [2, 0, 1, 0, 9], wire.encode_meta(rows, [4, 8]))
        kv = kv_at(d, 2.0)
        prompt = kv.prompt(list(range(40)), PromptIdentity())
        for workers in (("v:2", "x:9", "w:1", "u:3"), ["w:1"], ("u:3",)):
            d_ = kv.overlap(prompt, list(workers))
            for _ in range(2):  # the second time from the kept rows
                got = kv.overlap_array(prompt, workers)
                assert got is not None and got.tolist() == [d_.get(w, 0) for w in workers]
        assert kv.overlap_array(prompt, ("v:2", "x:9", "w:1")).tolist() == [1, 0, 2]  # type: ignore[union-attr]
        sizes = ("w:1", "v:2", "x:9")
        assert kv.block_sizes_of(sizes).tolist() == [4, 8, 4] == [kv.block_size(w) for w in sizes]
        done.set()
        t.join(5)


def test_workers_in_the_tables_order_take_the_answer_without_a_gather() -> None:
    """dec45: when the workers asked about are the shard table's first rows in order (the registry's order, as
    a pool's tuple usually is) the answer is read as it is; the same figures as the dict, a short answer (rows
    past it: workers the shard has not answered for yet) padded with zeros either way."""
    rows = [("w:1", 4, True, None), ("v:2", 4, True, None), ("u:3", 4, True, None)]
    for counts in ([2, 1, 5], [2, 1]):
        with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
            done = threading.Event()
            t = answering_shard(wire.lookup_socket(d, 0), done, counts, wire.encode_meta(rows, [4]))
            kv = kv_at(d, 2.0)
            prompt = kv.prompt(list(range(40)), PromptIdentity())
            for workers in (("w:1", "v:2", "u:3"), ("w:1", "v:2"), ("v:2", "w:1"), ()):
                want = kv.overlap(prompt, list(workers))
                for _ in range(2):  # the second time from the kept rows
                    got = kv.overlap_array(prompt, workers)
                    assert got is not None and got.dtype == np.int64
                    assert got.tolist() == [want.get(w, 0) for w in workers]
            assert kv._rows_memo is not None
            done.set()
            t.join(5)


def test_no_shard_means_an_overlap_array_of_zeros() -> None:
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        kv = kv_at(d, 2.0)
        got = kv.overlap_array(kv.prompt(list(range(12)), PromptIdentity()), ("w:1", "v:2"))
        assert got is not None and got.tolist() == [0, 0]


def test_a_storage_event_endpoint_travels_to_the_workers_shard_as_a_second_stream(caplog) -> None:
    # issue 44 under apart: the shard that owns the worker subscribes llm-d's file-system connector stream too
    # (it used to be dropped with a warning); a worker without one sends its GPU stream alone, as before
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        kv = kv_at(d, 2.0)
        with caplog.at_level("WARNING", logger="epp_extproc.adapters.kv_remote"):
            kv._registry.replace([Endpoint("w0", "10.0.0.1:8000", "tcp://10.0.0.1:5557",
                                           kv_storage_events="tcp://10.0.0.1:5559"),
                                  Endpoint("w1", "10.0.0.2:8000", "tcp://10.0.0.2:5557")])
        assert not [r for r in caplog.records if "storage-event endpoint" in r.getMessage()]
        assert kv._shard("10.0.0.1:8000").workers["10.0.0.1:8000"] == [["tcp://10.0.0.1:5557", None, None],
                                                                       ["tcp://10.0.0.1:5559", None, None, True]]
        assert kv._shard("10.0.0.2:8000").workers["10.0.0.2:8000"] == [["tcp://10.0.0.2:5557", None, None]]


def test_the_overlap_array_over_several_shards_is_the_overlap_dict_in_the_order_asked() -> None:
    """10,000 workers over 4 shards took the dict path: a Python loop over every candidate per decision
    (bench_tenk). Several shards now answer into one array too; a shard that does not answer reads 0."""
    names = [f"10.0.0.{i}:8000" for i in range(1, 40)]
    by_shard = [[w for w in names if wire.shard_of(w, 3) == k][:3] for k in range(3)]
    assert all(len(ws) == 3 for ws in by_shard)
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        threads = []
        for k in (0, 1):  # shard 2 is down
            rows = [(by_shard[k][0], 4, True, None), ("", 0, False, None), (by_shard[k][1], 4, True, None),
                    (by_shard[k][2], 4, True, None)]
            counts = [10 * (k + 1) + 1, 0, 10 * (k + 1) + 2, 0]
            threads.append(answering_shard(wire.lookup_socket(d, k), done, counts, wire.encode_meta(rows, [4])))
        kv = RemoteKv(EndpointRegistry(), directory=d, shards=3, block_size=4, prediction_ttl_s=0.0,
                      lookup_timeout_s=2.0, ask_server_info=False)
        prompt = kv.prompt(list(range(40)), PromptIdentity())
        everyone = tuple(w for ws in by_shard for w in ws)[::-1]
        for workers in (everyone, (by_shard[1][1], "x:9", by_shard[0][0]), (by_shard[2][0],)):
            want = kv.overlap(prompt, list(workers))
            for _ in range(2):  # the second time from the kept places
                got = kv.overlap_array(prompt, workers)
                assert got is not None and got.tolist() == [want.get(w, 0) for w in workers]
        got = kv.overlap_array(prompt, (by_shard[0][0], by_shard[1][1], by_shard[2][0], by_shard[0][2]))
        assert got is not None and got.tolist() == [11, 22, 0, 0]
        done.set()
        for t in threads:
            t.join(5)
