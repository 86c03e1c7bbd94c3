"""LoadTracker: peers' bookings add to the load the cost sees, and every local change reaches listeners."""

from __future__ import annotations

import pytest

from epp_extproc.config import Config
from epp_extproc.core.load import BookingChange, HeldBooking, LoadTracker
from epp_extproc.processes import child_configs


def test_local_changes_reach_listeners_in_order() -> None:
    t = LoadTracker()
    seen: list[BookingChange] = []
    t.add_listener(seen.append)
    b = t.book("a", 4)
    b.prefill_done()
    b.move("b")
    b.free()
    b.free()  # idempotent: no second event
    assert [(c.kind, c.address) for c in seen] == [("book", "a"), ("prefill_done", "a"), ("move", "b"),
                                                   ("free", "b")]
    assert seen[0].prefill_blocks == 4 and len({c.id for c in seen}) == 1


def test_peer_bookings_add_to_the_endpoint_load_but_not_to_own_inflight() -> None:
    t = LoadTracker()
    t.book("a", 2)
    t.peer_change("p1", BookingChange("book", "x", "a", 3, 3))
    ld = t.load("a")
    assert (ld.inflight, ld.prefill_blocks, ld.decode_blocks) == (2, 5, 5)
    assert t.total_inflight() == 1 and t.peer_inflight("p1") == 1


def test_a_snapshot_replaces_what_the_peer_had() -> None:
    t = LoadTracker()
    t.peer_change("p1", BookingChange("book", "x", "a", 3, 3))
    t.peer_snapshot("p1", [HeldBooking("y", "b", 1, 1, False)])
    assert t.load("a").inflight == 0
    assert (t.load("b").inflight, t.load("b").prefill_blocks, t.load("b").decode_blocks) == (1, 0, 1)


def test_dropping_a_peer_leaves_no_residue() -> None:
    t = LoadTracker()
    for i in range(5):
        t.peer_change("p1", BookingChange("book", f"x{i}", "a", 1.5, 1.5))
    t.peer_change("p1", BookingChange("prefill_done", "x0", ""))
    t.peer_change("p1", BookingChange("move", "x1", "b"))
    assert t.drop_peer("p1") == 5
    assert t.load("a").inflight == t.load("b").inflight == 0 and t.load("a").decode_blocks == 0
    assert t.peers() == []


def test_changes_for_unknown_ids_are_ignored() -> None:
    t = LoadTracker()
    t.peer_change("p1", BookingChange("free", "nope", "a"))
    t.peer_change("p1", BookingChange("prefill_done", "nope", "a"))
    assert t.load("a").inflight == 0


def test_a_peer_cannot_hold_more_than_the_cap() -> None:
    t = LoadTracker(max_bookings_per_peer=3)
    for i in range(10):
        t.peer_change("p1", BookingChange("book", f"x{i}", "a", 1, 1))
    assert t.peer_inflight("p1") == 3 and t.load("a").inflight == 3 and t.peer_bookings_refused == 7


def test_each_child_process_gets_its_socket_and_the_others_as_peers() -> None:
    cfg = Config(grpc_port=9002, health_port=9003, metrics_port=9090, processes=3)
    pairs = child_configs(cfg, "/run/x")
    kids, slots = [k for k, _ in pairs], [s for _, s in pairs]
    assert [s.sync_listen for s in slots] == [("unix:/run/x/p0.sock",), ("unix:/run/x/p1.sock",),
                                              ("unix:/run/x/p2.sock",)]
    assert kids[1].peer_list() == ["unix:/run/x/p0.sock", "unix:/run/x/p2.sock"]
    assert [(k.grpc_port, k.health_port, k.metrics_port) for k in kids] == [(9002, 9003, 9090), (9002, 0, 9091),
                                                                            (9002, 0, 9092)]
    assert [k.admin_port for k in kids] == [9091, 0, 0]  # 9090 + 1 is the default admin port: never reused
    assert all(s.share_port for s in slots) and [s.index for s in slots] == [0, 1, 2]
    assert all(k.processes == 1 for k in kids)


def test_processes_need_a_fixed_port_and_no_remote_peers() -> None:
    with pytest.raises(ValueError, match="fixed"):
        Config(grpc_port=0, processes=2).validate()
    with pytest.raises(ValueError, match="cannot be combined"):
        Config(processes=2, peers="10.0.0.2:9004").validate()
