"""Flow control on plain values: the queue (bands, fairness, FIFO, TTL, shedding, cancellation), the
saturation detector and the objective table. The Envoy-level behaviour is in
tests/integration/test_flow_control_gateway.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from epp_extproc.core.errors import PickError
from epp_extproc.core.flow_objectives import FlowKey, ObjectiveTable, parse_objectives
from epp_extproc.core.flow_queue import (
    DROPPED_REASON_HEADER,
    REASON_NO_ENDPOINTS,
    REASON_SATURATED,
    REASON_TTL,
    FlowController,
    reason_of,
)
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.saturation import SaturationDetector, Thresholds, WorkerSample
from epp_extproc.envoy.errors import http_error


def status(e: PickError) -> int:
    """What the client sees (the edge's one mapping)."""
    return http_error(e, "/v1/chat/completions").status


class Room:
    """A detector stand-in: the pool can take `n` more requests."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def headroom(self, addresses: Sequence[str]) -> int:
        return self.n if list(addresses) else 0


def controller(room: Room, ttl_s: float = 5.0, max_queued: int = 100,
               addresses: Sequence[str] = ("w1:1",)) -> FlowController:
    return FlowController(room, lambda: list(addresses), ttl_s=ttl_s, max_queued=max_queued)  # type: ignore[arg-type]


def key(priority: int = 0, flow: str = "default-flow") -> FlowKey:
    return FlowKey(priority, flow)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_admits_at_once_when_the_pool_has_room() -> None:
    fc = controller(Room(1))
    ticket = await asyncio.wait_for(fc.admit(key()), 1)
    assert fc.pending == 1 and fc.size == 0
    ticket.release()
    ticket.release()  # idempotent
    assert fc.pending == 0


async def test_pending_tickets_use_up_headroom_so_a_burst_cannot_overshoot() -> None:
    fc = controller(Room(2))
    t1 = await fc.admit(key())
    t2 = await fc.admit(key())
    third = asyncio.create_task(fc.admit(key()))
    await settle()
    assert not third.done() and fc.size == 1
    t1.release()  # booked: in the real detector the booking now counts; here the room is unchanged
    await settle()
    assert third.done()
    t2.release()
    (await third).release()


async def test_queued_request_is_dispatched_when_headroom_appears() -> None:
    room = Room(0)
    fc = controller(room)
    task = asyncio.create_task(fc.admit(key()))
    await settle()
    assert not task.done() and fc.size == 1
    room.n = 1
    assert fc.dispatch() == 1
    ticket = await asyncio.wait_for(task, 1)
    assert ticket.waited_s >= 0 and fc.size == 0


async def test_higher_band_is_dispatched_first_whatever_the_arrival_order() -> None:
    room = Room(0)
    fc = controller(room)
    done: list[str] = []

    async def one(name: str, priority: int) -> None:
        t = await fc.admit(key(priority))
        done.append(name)
        t.release()

    tasks = [asyncio.create_task(one(f"low{i}", 0)) for i in range(3)]
    await settle()
    tasks += [asyncio.create_task(one(f"high{i}", 10)) for i in range(2)]
    await settle()
    for _ in range(5):
        room.n = 1
        fc.dispatch()
        room.n = 0
        await settle()
    await asyncio.gather(*tasks)
    assert done == ["high0", "high1", "low0", "low1", "low2"]


async def test_flows_in_a_band_take_turns_and_each_flow_is_fifo() -> None:
    room = Room(0)
    fc = controller(room)
    done: list[str] = []

    async def one(name: str, flow: str) -> None:
        t = await fc.admit(key(0, flow))
        done.append(name)
        t.release()

    tasks = [asyncio.create_task(one(f"a{i}", "a")) for i in range(6)]  # a is backlogged first ...
    await settle()
    tasks += [asyncio.create_task(one(f"b{i}", "b")) for i in range(2)]
    await settle()
    for _ in range(8):
        room.n = 1
        fc.dispatch()
        room.n = 0
        await settle()
    await asyncio.gather(*tasks)
    assert done[:4] == ["a0", "b0", "a1", "b1"]  # ... but b is served every other turn
    assert [d for d in done if d.startswith("a")] == [f"a{i}" for i in range(6)]


async def test_request_that_waits_past_the_ttl_gets_429_ttl_expired() -> None:
    fc = controller(Room(0), ttl_s=0.05)
    with pytest.raises(PickError) as e:
        await asyncio.wait_for(fc.admit(key()), 2)
    assert status(e.value) == 429 and reason_of(e.value) == REASON_TTL
    assert (DROPPED_REASON_HEADER, REASON_TTL) in e.value.headers
    assert fc.size == 0 and fc.pending == 0


async def test_ttl_expiry_after_the_pool_emptied_is_503_no_endpoints() -> None:
    addresses = ["w1:1"]
    fc = FlowController(Room(0), lambda: list(addresses), ttl_s=0.05)  # type: ignore[arg-type]
    task = asyncio.create_task(fc.admit(key()))
    await settle()
    addresses.clear()
    with pytest.raises(PickError) as e:
        await asyncio.wait_for(task, 2)
    assert status(e.value) == 503 and reason_of(e.value) == REASON_NO_ENDPOINTS


async def test_no_endpoint_at_all_is_503_at_once() -> None:
    fc = controller(Room(5), addresses=())
    with pytest.raises(PickError) as e:
        await fc.admit(key())
    assert status(e.value) == 503 and reason_of(e.value) == REASON_NO_ENDPOINTS


async def test_sheddable_request_is_rejected_at_once_while_saturated() -> None:
    fc = controller(Room(0), ttl_s=10)
    with pytest.raises(PickError) as e:
        await asyncio.wait_for(fc.admit(key(-1)), 0.5)
    assert status(e.value) == 429 and reason_of(e.value) == REASON_SATURATED
    assert fc.size == 0


async def test_sheddable_request_goes_through_when_there_is_room() -> None:
    fc = controller(Room(1))
    (await asyncio.wait_for(fc.admit(key(-5)), 1)).release()


async def test_cancelled_waiter_leaves_nothing_behind() -> None:
    room = Room(0)
    fc = controller(room)
    task = asyncio.create_task(fc.admit(key(0, "gone")))
    await settle()
    assert fc.size == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fc.size == 0 and fc.pending == 0 and fc.snapshot()["bands"] == {}
    room.n = 1
    assert fc.dispatch() == 0  # nothing left to grant, and no headroom was taken


async def test_cancel_racing_a_grant_gives_the_headroom_back() -> None:
    room = Room(0)
    fc = controller(room)
    task = asyncio.create_task(fc.admit(key()))
    await settle()
    room.n = 1
    fc.dispatch()  # granted, but the waiter has not run yet ...
    task.cancel()  # ... and its client goes away first
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fc.pending == 0


async def test_full_queue_rejects_with_429_saturated() -> None:
    fc = controller(Room(0), max_queued=2)
    tasks = [asyncio.create_task(fc.admit(key())) for _ in range(2)]
    await settle()
    with pytest.raises(PickError) as e:
        await fc.admit(key())
    assert status(e.value) == 429 and reason_of(e.value) == REASON_SATURATED
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_full_queue_displaces_the_newest_lower_priority_request() -> None:
    room = Room(0)
    fc = controller(room, max_queued=2)
    low = [asyncio.create_task(fc.admit(key(0))) for _ in range(2)]
    await settle()
    high = asyncio.create_task(fc.admit(key(5)))
    await settle()
    with pytest.raises(PickError) as e:
        await low[1]
    assert status(e.value) == 429 and fc.size == 2
    room.n = 1
    fc.dispatch()
    (await asyncio.wait_for(high, 1)).release()
    fc.dispatch()
    (await asyncio.wait_for(low[0], 1)).release()


async def test_close_answers_every_queued_request_503() -> None:
    fc = controller(Room(0))
    task = asyncio.create_task(fc.admit(key()))
    await settle()
    fc.close()
    with pytest.raises(PickError) as e:
        await task
    assert status(e.value) == 503 and fc.size == 0


# ------------------------------------------------------------------------------------------- detector
def detector(th: Thresholds, load: LoadTracker, now: list[float]) -> SaturationDetector:
    return SaturationDetector(th, load.loads, block_size=32, clock=lambda: now[0])


def test_worker_is_saturated_when_its_engine_queue_reaches_the_threshold() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(queue_depth=3), load, now)
    d.observe("w", WorkerSample(waiting=2, running=4, kv_utilization=0.1, at=100.0))
    assert not d.state("w").saturated
    d.observe("w", WorkerSample(waiting=3, running=4, kv_utilization=0.1, at=100.01))
    assert d.state("w").saturated and d.headroom(["w"]) == 0


def test_requests_booked_since_the_scrape_count_until_the_next_one() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(queue_depth=2), load, now)
    d.observe("w", WorkerSample(waiting=1, running=4, kv_utilization=0.0, at=100.0, max_running=4))
    assert d.state("w").headroom == 1
    b = load.book("w", 1)  # sent after the scrape: the engine queue is now 2 deep
    assert d.state("w").saturated
    b.free()  # and one finished: back to 1
    assert not d.state("w").saturated


def test_kv_utilization_above_threshold_saturates() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(kv_utilization=0.8), load, now)
    d.observe("w", WorkerSample(waiting=0, running=1, kv_utilization=0.85, at=100.0))
    assert d.state("w").saturated


def test_stale_sample_is_ignored_and_bookings_alone_decide() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(queue_depth=1, staleness_s=0.2, prefill_tokens=64), load, now)
    d.observe("w", WorkerSample(waiting=9, running=9, kv_utilization=0.99, at=100.0))
    assert d.state("w").saturated
    now[0] = 100.5
    assert not d.state("w").saturated
    load.book("w", 2)  # 2 blocks of 32 tokens in prefill = 64 tokens: the bookings rule
    assert d.state("w").saturated


def test_pool_has_headroom_while_any_eligible_worker_has() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(queue_depth=1), load, now)
    d.observe("a", WorkerSample(waiting=3, running=4, kv_utilization=0.1, at=100.0))
    d.observe("b", WorkerSample(waiting=0, running=1, kv_utilization=0.1, at=100.0))
    assert d.headroom(["a"]) == 0 and d.headroom(["a", "b"]) > 0


def test_unbooked_requests_are_what_the_engine_runs_beyond_this_pickers_bookings() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(), load, now)
    d.observe("w", WorkerSample(waiting=2, running=5, kv_utilization=0.1, at=100.0, booked_inflight=3))
    assert d.unbooked_requests("w") == 4
    now[0] = 200.0
    assert d.unbooked_requests("w") == 0  # stale: no claim about other gateways


# ------------------------------------------------------------------------------------------- objectives
def test_objective_header_picks_the_priority_and_unknown_is_zero() -> None:
    t = ObjectiveTable({"premium": 10, "batch": -1})
    assert t.flow_key({"x-gateway-inference-objective": ["premium"]}).priority == 10
    assert t.flow_key({"x-llm-d-inference-objective": ["batch"]}).priority == -1
    assert t.flow_key({"x-gateway-inference-objective": ["nope"]}).priority == 0
    assert t.flow_key({}).priority == 0


def test_fairness_id_header_names_the_flow_and_is_bounded() -> None:
    t = ObjectiveTable()
    assert t.flow_key({}).fairness_id == "default-flow"
    assert t.flow_key({"x-gateway-inference-fairness-id": ["tenant-a"]}).fairness_id == "tenant-a"
    assert len(t.flow_key({"x-gateway-inference-fairness-id": ["x" * 10_000]}).fairness_id) == 128


def test_objectives_file_accepts_a_map_a_list_and_crd_manifests() -> None:
    assert parse_objectives({"a": 1}) == {"a": 1}
    assert parse_objectives([{"name": "a", "priority": 2}]) == {"a": 2}
    crd = {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
           "metadata": {"name": "premium"}, "spec": {"priority": 10, "poolRef": {"name": "pool"}}}
    assert parse_objectives(crd) == {"premium": 10}
    assert parse_objectives({"kind": "List", "items": [crd]}) == {"premium": 10}
    with pytest.raises(ValueError):
        parse_objectives({"a": "high"})


def test_queue_depth_zero_saturates_as_soon_as_the_batch_is_full() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(queue_depth=0), load, now)
    d.observe("w", WorkerSample(waiting=0, running=3, kv_utilization=0.1, at=100.0, max_running=4))
    assert d.state("w").headroom == 1
    load.book("w", 1)
    assert d.state("w").saturated


def test_unknown_batch_size_still_admits_one_request_per_scrape() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(queue_depth=0), load, now)
    d.observe("w", WorkerSample(waiting=0, running=0, kv_utilization=0.0, at=100.0))  # idle, never seen busy
    assert d.state("w").headroom == 1
    load.book("w", 1)
    assert d.state("w").saturated


async def test_dispatches_are_counted_per_flow_and_bounded() -> None:
    fc = controller(Room(10_000), max_queued=10_000)
    for i in range(1030):
        (await fc.admit(key(0, f"f{i}"))).release()
    (await fc.admit(key(0, "f1029"))).release()
    assert len(fc.served) <= 1024 and fc.served[(0, "f1029")] == 2 and (0, "f0") not in fc.served


def test_request_on_its_way_to_the_engine_still_counts() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(queue_depth=0), load, now)
    load.book("w", 1)  # booked; the scrape below does not show it yet (still in Envoy)
    d.observe("w", WorkerSample(waiting=0, running=0, kv_utilization=0.0, at=100.0, booked_inflight=1,
                                max_running=1))
    assert d.state("w").saturated


def test_stale_metrics_fall_back_to_bookings_against_the_known_batch() -> None:
    load, now = LoadTracker(), [100.0]
    d = detector(Thresholds(queue_depth=0, staleness_s=0.2), load, now)
    d.observe("w", WorkerSample(waiting=0, running=2, kv_utilization=0.0, at=100.0, booked_inflight=2,
                                max_running=2))
    now[0] = 105.0  # the scrapes stopped answering: a flood must not get through
    load.book("w", 1)
    assert d.state("w").headroom == 1
    load.book("w", 1)
    assert d.state("w").saturated
