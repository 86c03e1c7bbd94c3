"""bench_trace's method (issue 28): capacities derived from the working set, claims only on disjoint spreads."""

from __future__ import annotations

from typing import Any

import pytest

from bench.bench_trace import capacity_blocks, claims, parse_capacities, targets


def test_capacities_put_the_working_set_at_the_named_pressure_over_the_pool() -> None:
    ws, workers = 4000, 4
    assert capacity_blocks("ample", ws, workers, 10) == 8000  # every worker could hold it all twice
    assert ws / (4 * capacity_blocks("75", ws, workers, 10)) == pytest.approx(1.33, abs=0.01)
    assert ws / (4 * capacity_blocks("scarce", ws, workers, 10)) == pytest.approx(2.5, abs=0.01)


def test_capacity_is_floored_at_twice_the_largest_request_so_nothing_waits_forever() -> None:
    assert capacity_blocks("scarce", 400, 4, 250) == 500


def test_unknown_capacity_names_fail_before_anything_starts() -> None:
    assert parse_capacities("ample, 75,scarce") == ("ample", "75", "scarce")
    with pytest.raises(SystemExit):
        parse_capacities("ample,huge")


def _runs(ttft_p90: list[float], cached: list[float]) -> list[dict[str, Any]]:
    return [{"ttft_p90_ms": t, "aiperf_cached_ratio": c} for t, c in zip(ttft_p90, cached, strict=True)]


def _doc() -> dict[str, Any]:
    """(a) and (c) at one load: (c)'s TTFT p90 clearly lower, its cached ratio overlapping (a)'s."""
    def cell(cfg: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"capacity": "75", "config": cfg, "offered_rps": 10.0, "divisor": 25.0, "runs": runs,
                "summary": {"ttft_p90_ms": {"median": sorted(r["ttft_p90_ms"] for r in runs)[1]},
                            "aiperf_cached_ratio": {"median": sorted(r["aiperf_cached_ratio"] for r in runs)[1]}}}
    return {"result": {"cells": [cell("a", _runs([1000, 1100, 1200], [0.3, 0.4, 0.5])),
                                 cell("c", _runs([100, 110, 120], [0.45, 0.5, 0.6]))],
                       "capacities": [{"name": "75", "oracle": {"pooled_lru": 0.6},
                                       "clairvoyant": [{"offered_rps": 10.0, "cached_ratio": {"median": 0.5}}]}]}}


def test_claims_orient_latencies_as_baseline_over_config_and_withhold_overlapping_ones() -> None:
    doc = _doc()
    doc["claims"] = claims(doc)
    by_metric = {k["metric"]: k for k in doc["claims"] if (k["config"], k["baseline"]) == ("c", "a")}
    assert by_metric["ttft_p90_ms"]["claim"] == pytest.approx(1100 / 110)
    assert by_metric["aiperf_cached_ratio"]["claim"] is None  # 0.45..0.6 overlaps 0.3..0.5
    assert by_metric["aiperf_cached_ratio"]["median_ratio"] == pytest.approx(0.5 / 0.4)


def test_the_5x_target_is_met_only_by_a_claim_and_cached_is_judged_against_the_clairvoyant() -> None:
    doc = _doc()
    doc["claims"] = claims(doc)
    t = targets(doc)["75"]
    assert t["c_ttft_p90_5x_below_a_at_saturation"]["met"] is True
    cached = t["c_cached_within_5pct_of_clairvoyant"]
    assert cached["met"] is True and cached["per_load"][0]["c_over_pooled_lru"] == pytest.approx(0.5 / 0.6)
    doc["result"]["cells"][1]["runs"][0]["ttft_p90_ms"] = 1000.0  # now (c)'s spread touches (a)'s: no claim
    doc["claims"] = claims(doc)
    assert targets(doc)["75"]["c_ttft_p90_5x_below_a_at_saturation"]["met"] is False


def _gap_doc(c_cached: float, e_cached: float, cv_cached: float | None, c_ttft: float = 300.0,
             e_ttft: float = 600.0, cv_ttft: float = 200.0) -> dict[str, Any]:
    def cell(cfg: str, ttft: float, cached: float) -> dict[str, Any]:
        runs = _runs([ttft * 0.95, ttft, ttft * 1.05], [cached - 0.005, cached, cached + 0.005])
        return {"capacity": "75", "config": cfg, "offered_rps": 25.0, "divisor": 1.0, "runs": runs,
                "summary": {"ttft_p90_ms": {"median": ttft}, "aiperf_cached_ratio": {"median": cached}}}
    cells = [cell("c", c_ttft, c_cached), cell("e", e_ttft, e_cached)]
    if cv_cached is not None:
        cells.append(cell("cv", cv_ttft, cv_cached))
    doc: dict[str, Any] = {"result": {"cells": cells, "capacities": [
        {"name": "75", "oracle": {"pooled_lru": 0.6},
         "clairvoyant": [{"offered_rps": 25.0, "cached_ratio": {"median": 0.65}}]}]}}
    doc["claims"] = claims(doc)
    return doc


def test_the_half_gap_target_is_judged_against_the_replayed_clairvoyant() -> None:
    t = targets(_gap_doc(c_cached=0.55, e_cached=0.40, cv_cached=0.60))["75"]["c_closes_half_the_gap_from_e_to_clairvoyant"]
    by = {p["metric"]: p for p in t["per_load"]}
    assert by["aiperf_cached_ratio"]["bound_source"] == "replayed"
    assert by["aiperf_cached_ratio"]["closed"] == pytest.approx(0.75)
    assert by["ttft_p90_ms"]["closed"] == pytest.approx(0.75)  # (600 - 300) / (600 - 200)
    assert t["met"] is True


def test_the_half_gap_target_is_missed_below_half_and_when_c_is_worse_than_e() -> None:
    t = targets(_gap_doc(c_cached=0.45, e_cached=0.40, cv_cached=0.60))["75"]["c_closes_half_the_gap_from_e_to_clairvoyant"]
    assert t["met"] is False  # a quarter of the cached gap
    t = targets(_gap_doc(c_cached=0.55, e_cached=0.40, cv_cached=0.60, c_ttft=900.0))["75"][
        "c_closes_half_the_gap_from_e_to_clairvoyant"]
    assert t["met"] is False and [k["metric"] for k in t["c_worse_than_e"]] == ["ttft_p90_ms"]


def test_without_a_replay_only_the_cached_ratio_is_judged_against_the_offline_clairvoyant() -> None:
    t = targets(_gap_doc(c_cached=0.55, e_cached=0.45, cv_cached=None))["75"]["c_closes_half_the_gap_from_e_to_clairvoyant"]
    assert [(p["metric"], p["bound_source"]) for p in t["per_load"]] == [("aiperf_cached_ratio", "offline")]
    assert t["per_load"][0]["closed"] == pytest.approx(0.5)


def test_a_bound_no_better_than_e_leaves_no_gap_and_is_met_when_c_is_no_worse() -> None:
    t = targets(_gap_doc(c_cached=0.55, e_cached=0.40, cv_cached=0.60, c_ttft=500.0, e_ttft=600.0, cv_ttft=700.0))[
        "75"]["c_closes_half_the_gap_from_e_to_clairvoyant"]
    ttft = next(p for p in t["per_load"] if p["metric"] == "ttft_p90_ms")
    assert ttft["closed"] is None and ttft["met"] is True
