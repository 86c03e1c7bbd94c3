"""--affinity-load-bound: the cached prefix first among the workers within the load bound, weighed against the
load it joins (--affinity-rule weighed, the default since issue 42), or the longest prefix outright (`longest`)."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from epp_extproc.cli import load_config
from epp_extproc.config import Config
from epp_extproc.core.load import EndpointLoad
from epp_extproc.core.scheduling.bounded_load_picker import BoundedLoadPicker
from tests.scheduling_fakes import (
    ADDRS,
    CostParams,
    Row,
    chat,
    choose,
    choose_bounded,
    choose_with,
    decide,
    make,
)

P = CostParams(overlap_credit=2.0)


def cand(address: str, held: float, overlap: int = 0, prompt: float = 40.0, prefill: float = 0.0) -> Row:
    return Row(address, EndpointLoad(inflight=1 if held else 0, prefill_blocks=prefill, decode_blocks=held),
                     prompt_blocks=prompt, overlap_blocks=overlap)


def test_the_cached_worker_keeps_the_request_when_a_lighter_one_would_win_on_cost() -> None:
    # the cost moves a 36-of-40-block prefix to the worker 200 blocks lighter; within 25% of the average it stays
    cands = [cand("hot", 500, overlap=36), cand("cold", 300), cand("c2", 400), cand("c3", 400)]
    assert choose(cands, P).address == "cold"
    assert choose_bounded(cands, P, 0.25).address == "hot"


def test_a_cached_worker_above_the_bound_loses_to_the_cost() -> None:
    cands = [cand("hot", 900, overlap=36), cand("cold", 100), cand("c2", 400), cand("c3", 400)]
    # average 450: the bound is 1.25 x 450 + 40 = 602.5 blocks, the hot worker holds 900
    assert choose_bounded(cands, P, 0.25).address == choose(cands, P).address == "cold"


def test_the_longest_prefix_among_the_bounded_workers_wins_under_the_longest_rule() -> None:
    cands = [cand("short", 100, overlap=10), cand("long", 150, overlap=30), cand("cold", 0)]
    assert choose_bounded(cands, P, 0.5, rule="longest").address == "long"


def test_the_longer_prefix_wins_among_equally_loaded_workers() -> None:
    cands = [cand("short", 100, overlap=10), cand("long", 100, overlap=30), cand("c", 100)]
    assert choose_bounded(cands, P, 0.5).address == "long"


def test_an_idle_worker_takes_the_request_from_loaded_workers_holding_only_a_shared_system_prompt() -> None:
    # issue 42: three workers hold a 2-block system prompt of a 5-block prompt and carry the load; the fourth
    # never served a request, so holds nothing. The longest-prefix rule sent it nothing, ever: every loaded
    # worker is within (1 + 0.5) x the average (15 blocks) plus the prompt
    cands = [cand("a", 20, overlap=2, prompt=5), cand("b", 20, overlap=2, prompt=5),
             cand("c", 20, overlap=2, prompt=5), cand("idle", 0, prompt=5)]
    assert choose_bounded(cands, P, 0.5, rule="longest").address != "idle"
    assert choose_bounded(cands, P, 0.5).address == "idle"


def test_a_worker_holding_the_whole_prompt_keeps_it_up_to_the_bound_over_an_idle_one() -> None:
    # the same pool, the prompt wholly cached on the loaded workers: affinity is worth the bound's span
    cands = [cand("a", 20, overlap=5, prompt=5), cand("b", 20, overlap=5, prompt=5),
             cand("c", 20, overlap=5, prompt=5), cand("idle", 0, prompt=5)]
    assert choose_bounded(cands, P, 0.5).address in {"a", "b", "c"}


def test_a_prefix_buys_affinity_in_proportion_to_the_share_of_the_prompt_it_covers() -> None:
    # average held 60 blocks, span (1 + 0.5) x 60 = 90 blocks: 10 of 40 blocks cached buys 22.5 blocks of
    # load, 30 of 40 buys 67.5; "hot" is 60 blocks heavier than "cold"
    def pool(overlap: int) -> list[Row]:
        return [cand("hot", 90, overlap=overlap), cand("cold", 30), cand("c2", 60), cand("c3", 60)]
    assert choose_bounded(pool(10), P, 0.5).address == "cold"
    assert choose_bounded(pool(30), P, 0.5).address == "hot"


def test_an_idle_pool_is_placed_by_the_cost_alone() -> None:
    # nothing is held anywhere (average 0): the weighed rule adds nothing to the block cost's own credit
    cands = [cand("short", 0, overlap=10, prefill=30), cand("long", 0, overlap=2), cand("cold", 0)]
    assert choose_bounded(cands, P, 0.5).address == choose(cands, P).address == "long"


def test_the_rule_is_weighed_by_default_and_an_unknown_one_is_refused() -> None:
    assert Config().affinity_rule == "weighed"
    assert load_config(["--affinity-rule", "longest"], env={}).affinity_rule == "longest"
    with pytest.raises(SystemExit):
        load_config(["--affinity-rule", "nearest"], env={})
    with pytest.raises(ValueError, match="rule must be one of weighed, longest"):
        BoundedLoadPicker(0.5, rule="nearest")


def test_equal_prefixes_are_decided_by_the_cost() -> None:
    cands = [cand("a", 300, overlap=20), cand("b", 100, overlap=20), cand("cold", 0)]
    assert choose_bounded(cands, P, 1.0).address == "b"


def test_a_prompt_nobody_holds_is_placed_by_the_cost_alone() -> None:
    rng_a, rng_b = random.Random(3), random.Random(3)
    cands = [cand("a", 120), cand("b", 80), cand("c", 80)]
    picks_bounded = Counter(choose_bounded(cands, P, 0.25, rng_a).address for _ in range(50))
    picks_cost = Counter(choose(cands, P, rng_b).address for _ in range(50))
    assert picks_bounded == picks_cost and set(picks_bounded) == {"b", "c"}


def test_an_idle_pool_keeps_affinity() -> None:
    cands = [cand("hot", 0, overlap=5), cand("cold", 0)]
    assert choose_bounded(cands, P, 0.01).address == "hot"


def test_a_lightly_loaded_cached_worker_keeps_affinity_though_above_the_average() -> None:
    # one request in flight on the cached worker is 4x the average of four workers: the request's own blocks
    # are the slack that keeps a lightly loaded pool from copying the prefix elsewhere
    cands = [cand("hot", 40, overlap=30), cand("b", 0), cand("c", 0), cand("d", 0)]
    assert choose_bounded(cands, P, 0.25).address == "hot"


def test_every_candidate_gets_its_cost_for_debug_score() -> None:
    cands = [cand("hot", 500, overlap=36), cand("cold", 300)]
    choose_bounded(cands, P, 0.25)
    assert [c.cost for c in cands] == [500.0, 340.0]


def test_the_eviction_discount_lowers_a_prefix_as_the_cost_sees_it() -> None:
    hot, warm = cand("hot", 100, overlap=30), cand("warm", 100, overlap=20)
    hot.overlap_discount = 15
    assert choose_bounded([hot, warm, cand("cold", 100)], P, 0.25).address == "warm"


async def test_the_pipeline_picks_within_the_bound_only_when_the_flag_is_set() -> None:
    # ADDRS[0] holds 2 blocks of every prompt (the fake index); one booking of 3 blocks on it makes the cost
    # prefer the idle ADDRS[1]
    outcomes = {}
    for bound in (0.0, 0.25):
        pipe, _, _ = make(affinity_load_bound=bound, affinity_rule="longest", prefill_load_scale=1.0)
        pipe.load.book(ADDRS[0], 3)
        outcomes[bound] = (await decide(pipe, chat(b'{"messages":[]}'))).address
    assert outcomes == {0.0: ADDRS[1], 0.25: ADDRS[0]}


async def test_the_pipeline_leaves_a_worker_above_the_bound() -> None:
    pipe, _, _ = make(affinity_load_bound=0.25)
    pipe.load.book(ADDRS[0], 20)  # average 10: bound 12.5 + the prompt's 3.1 blocks
    assert (await decide(pipe, chat(b'{"messages":[]}'))).address == ADDRS[1]


def test_the_bound_is_on_by_default_and_refuses_a_negative_value() -> None:
    assert Config().affinity_bounds() == (0.5, None)
    with pytest.raises(ValueError, match="must be >= 0"):
        Config(affinity_load_bound=-1).validate()


@pytest.mark.parametrize("tiers", [{"tiered_credit": True}, {"router_host_cache_hit_weight": 0.75},
                                   {"router_disk_cache_hit_weight": 0.3}])
def test_tier_credit_widens_the_unset_bound_to_2_while_blocks_sit_off_the_gpu(tiers: dict[str, Any]) -> None:
    assert Config(**tiers).affinity_bounds() == (0.5, 2.0)
    assert Config(**tiers).sections.scheduling.affinity_bounds() == (0.5, 2.0)


def test_a_bound_set_is_the_bound_with_or_without_tiers() -> None:
    assert Config(tiered_credit=True, affinity_load_bound=0.5).affinity_bounds() == (0.5, None)
    assert Config(tiered_credit=True, affinity_load_bound=0.0).affinity_bounds() == (0.0, None)


def test_the_flag_and_its_env_name_set_the_bound_and_unset_leaves_the_defaults() -> None:
    assert load_config(["--affinity-load-bound", "1.5", "--tiered-credit"], env={}).affinity_bounds() == (1.5, None)
    assert load_config([], env={"DYN_EPP_AFFINITY_LOAD_BOUND": "0.25"}).affinity_bounds() == (0.25, None)
    assert load_config(["--tiered-credit"], env={}).affinity_bounds() == (0.5, 2.0)


def test_the_tiered_bound_keeps_a_cached_worker_past_the_gpu_bound_only_while_blocks_sit_off_the_gpu() -> None:
    # average 450: 1.5 x 450 + 40 = 715 blocks leaves the hot worker (900) out; 3 x 450 + 40 = 1,390 keeps it
    cands = [cand("hot", 900, overlap=36), cand("cold", 100), cand("c2", 400), cand("c3", 400)]
    off_gpu = [False]
    picker = BoundedLoadPicker(0.5, tiered_bound=2.0, has_tiers=lambda: off_gpu[0])
    assert choose_with(cands, P, picker).address == "cold"
    off_gpu[0] = True
    assert choose_with(cands, P, picker).address == "hot"


class _TierView:
    def __init__(self) -> None:
        self.off_gpu = False

    def has_tiers(self) -> bool:
        return self.off_gpu


def test_the_picker_built_with_a_tiered_bound_asks_the_kv_view_whether_blocks_sit_off_the_gpu() -> None:
    view = _TierView()
    deps = SimpleNamespace(kv=view)
    picker = BoundedLoadPicker.create({"bound": 0.5, "tieredBound": 2.0}, deps)  # type: ignore[arg-type]
    assert picker.current_bound() == 0.5
    view.off_gpu = True
    assert picker.current_bound() == 2.0
    assert BoundedLoadPicker.create({"bound": 0.5}, deps).current_bound() == 0.5  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tieredBound"):
        BoundedLoadPicker.create({"bound": 0.5, "tieredBound": 2.0}, SimpleNamespace(kv=None))  # type: ignore[arg-type]


async def test_the_time_cost_ignores_the_bound() -> None:
    # the same booking that keeps the cached worker under the bound: the time cost (cold, so the block cost's
    # argmin) sends the request to the idle worker as it did before the bound existed
    pipe, _, _ = make(affinity_load_bound=0.25, cost_model="time", prefill_load_scale=1.0)
    pipe.config.validate()
    pipe.load.book(ADDRS[0], 3)
    assert (await decide(pipe, chat(b'{"messages":[]}'))).address == ADDRS[1]
