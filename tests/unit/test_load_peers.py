"""LoadTracker: peers' bookings add to the load the cost sees, and every local change reaches listeners."""

from __future__ import annotations

import pytest

from epp_extproc.config import Config
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import BookingChange, HeldBooking, LoadTracker
from epp_extproc.metrics import PickerMetrics
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


def test_booking_ids_never_collide_across_replicas() -> None:
    """Envoy opens a request's observer stream to any replica: a first chunk naming replica A's booking must
    not end the prefill of replica B's own booking that happens to have the same id (with a bare per-process
    counter both replicas' third booking was "epp-3")."""
    a, b = LoadTracker(), LoadTracker()
    mine = [b.book("w", 4) for _ in range(3)]
    theirs = [a.book("w", 4) for _ in range(3)]
    assert not {x.id for x in mine} & {x.id for x in theirs}
    LeanSignals(b, PickerMetrics()).first_chunk(theirs[2].id)
    assert all(x.prefilling for x in mine) and b.load("w").prefill_blocks == 12


def test_a_first_chunk_of_a_peers_booking_ends_its_prefill_here_and_goes_to_the_peer() -> None:
    t = LoadTracker()
    forwarded: list[tuple[str | None, str]] = []
    t.add_first_chunk_forwarder(lambda owner, bid: forwarded.append((owner, bid)))
    t.peer_change("p1", BookingChange("book", "epp-0a-1", "w", 5, 5))
    m = PickerMetrics()
    LeanSignals(t, m).first_chunk("epp-0a-1")
    assert t.load("w").prefill_blocks == 0 and t.load("w").decode_blocks == 5
    assert forwarded == [("p1", "epp-0a-1")]
    assert m.lean_signals.labels("first_chunk_forwarded")._value.get() == 1
    LeanSignals(t, m).first_chunk("epp-0b-9")  # not held (its booking not seen yet): every peer is asked
    assert forwarded[-1] == (None, "epp-0b-9")


def test_a_first_chunk_of_our_own_freed_booking_is_not_forwarded() -> None:
    t = LoadTracker()
    forwarded: list[tuple[str | None, str]] = []
    t.add_first_chunk_forwarder(lambda owner, bid: forwarded.append((owner, bid)))
    b = t.book("w", 2)
    b.free()
    m = PickerMetrics()
    LeanSignals(t, m).first_chunk(b.id)
    assert forwarded == [] and m.lean_signals.labels("first_chunk_unknown")._value.get() == 1


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
