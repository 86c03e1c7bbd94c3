"""The cost function, tie-breaking, the subset hint and load bookings."""

from __future__ import annotations

import random
from collections import Counter

from epp_extproc.core.load import LoadTracker
from epp_extproc.envoy.extproc import parse_subset
from tests.scheduling_fakes import CostParams, Row, choose, compute_cost, eligible, loads_for


def test_fewest_inflight_wins_when_prompts_are_unknown() -> None:
    t = LoadTracker()
    t.book("a", 0)
    t.book("a", 0)
    t.book("b", 0)
    c = choose(loads_for(["a", "b", "c"], t.loads()), CostParams())
    assert c.address == "c"


def test_exact_ties_are_broken_at_random() -> None:
    rng = random.Random(7)
    picks = Counter(choose(loads_for(["a", "b", "c"], {}), CostParams(), rng).address for _ in range(300))
    assert set(picks) == {"a", "b", "c"}
    assert min(picks.values()) > 60


def test_overlap_credit_lowers_the_cost() -> None:
    t = LoadTracker()
    a, b = loads_for(["a", "b"], t.loads())
    a.prompt_blocks = b.prompt_blocks = 10
    a.overlap_blocks = 8
    assert choose([a, b], CostParams()).address == "a"
    assert compute_cost(a, CostParams()) == 2 and compute_cost(b, CostParams()) == 10


def test_cost_is_the_dynamo_formula() -> None:
    t = LoadTracker()
    bk = t.book("a", 4)  # 4 blocks prefilling, 4 decoding
    c = Row("a", t.load("a"), prompt_blocks=6, overlap_blocks=3)
    p = CostParams(overlap_credit=2.0, prefill_load_scale=0.5)
    assert compute_cost(c, p) == 0.5 * max(4 + 6 - 2.0 * 3, 0) + 4
    bk.prefill_done()
    assert compute_cost(c, p) == 0.5 * max(0 + 6 - 6, 0) + 4


def test_temperature_samples_every_candidate_but_prefers_the_cheapest() -> None:
    rng = random.Random(1)
    t = LoadTracker()
    for _ in range(5):
        t.book("b", 1)
    picks = Counter(choose(loads_for(["a", "b"], t.loads()), CostParams(temperature=1.0), rng).address
                    for _ in range(2000))
    assert picks["a"] > picks["b"] > 0


def test_booking_release_is_idempotent_and_returns_to_zero() -> None:
    t = LoadTracker()
    b = t.book("a", 3.5)
    b.prefill_done()
    b.prefill_done()
    assert t.load("a").prefill_blocks == 0 and t.load("a").decode_blocks == 3.5
    b.free()
    b.free()
    assert t.load("a").inflight == 0 and t.total_inflight() == 0


def test_free_without_first_chunk_releases_prefill_too() -> None:
    t = LoadTracker()
    t.book("a", 2).free()
    assert t.load("a").prefill_blocks == 0


def test_subset_hint_accepts_list_and_comma_string() -> None:
    assert parse_subset("1.1.1.1:80, 2.2.2.2:80") == ["1.1.1.1:80", "2.2.2.2:80"]
    assert parse_subset(["1.1.1.1:80", "2.2.2.2:80,3.3.3.3:80"]) == ["1.1.1.1:80", "2.2.2.2:80", "3.3.3.3:80"]
    assert parse_subset(None) is None
    assert parse_subset(42) == []


def test_subset_hint_narrows_and_never_widens() -> None:
    assert eligible(["a", "b"], ["b", "z"]) == ["b"]
    assert eligible(["a", "b"], []) == []
    assert eligible(["a", "b"], None) == ["a", "b"]


def test_moving_a_booking_carries_its_load_and_frees_cleanly() -> None:
    t = LoadTracker()
    b = t.book("a", 4)
    b.move("b")
    assert (t.load("a").inflight, t.load("a").prefill_blocks, t.load("a").decode_blocks) == (0, 0, 0)
    assert (t.load("b").inflight, t.load("b").prefill_blocks, t.load("b").decode_blocks) == (1, 4, 4)
    b.prefill_done()
    b.free()
    assert t.load("b").inflight == 0 and t.total_inflight() == 0


def test_by_default_a_prefill_queued_ahead_outweighs_more_blocks_held_by_decoding_requests() -> None:
    # issue 42: a new request waits behind the prompts still prefilling on a worker, while each block held by a
    # decoding request slows a step by a small share. "queued" has 3 blocks still to prefill (6 in flight
    # in all), "decoding" holds 20 blocks of requests past their prefill. Dynamo's weight (1.0) sends the
    # request behind the queued prefill; the default (8.0, measured on the workload suite) does not.
    from epp_extproc.config import Config
    from epp_extproc.core.load import EndpointLoad

    def pool() -> list[Row]:
        return [Row("queued", EndpointLoad(inflight=1, prefill_blocks=3, decode_blocks=3), prompt_blocks=4),
                Row("decoding", EndpointLoad(inflight=4, decode_blocks=20), prompt_blocks=4)]
    assert choose(pool(), CostParams(prefill_load_scale=1.0)).address == "queued"
    assert choose(pool(), CostParams(prefill_load_scale=Config().prefill_load_scale)).address == "decoding"


def test_a_request_with_no_known_prompt_goes_to_the_fewest_requests_in_flight_whatever_the_prefill_weight() -> None:
    # load-only (no render): "a" has 1 request still prefilling, "b" 3 decoding; the prefill weight prices
    # blocks to prefill, and without a prompt there are none, only requests (weighed 8x, "a"'s would lose)
    t = LoadTracker()
    t.book("a", 0)
    for _ in range(3):
        t.book("b", 0).prefill_done()
    for scale in (1.0, 8.0):
        assert choose(loads_for(["a", "b"], t.loads()), CostParams(prefill_load_scale=scale)).address == "a"
