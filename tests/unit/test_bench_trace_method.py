"""bench_trace's method (issue 28): capacities derived from the working set, claims only on disjoint spreads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import bench_trace as BT
from bench import out_of_band as OB
from bench import trace_workload as T
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


# ----------------------------------------------------------------------------- issue 42 item 3
def test_the_out_of_band_subset_is_seeded_the_same_for_every_config_and_nested_across_shares() -> None:
    ten, thirty = OB.indices(400, 0.1, seed=0), OB.indices(400, 0.3, seed=0)
    assert len(ten) == 40 and len(thirty) == 120
    assert ten == OB.indices(400, 0.1, seed=0) and ten < thirty  # the 10% requests are among the 30%
    assert ten != OB.indices(400, 0.1, seed=1)
    assert 0 not in thirty and max(thirty) < 400  # request 0 is the replayer's clock: always in band
    assert OB.indices(24, 0.3) == OB.indices(24, 0.3) and len(OB.indices(24, 0.3)) == 7


def test_the_split_keeps_aiperf_s_schedule_and_sends_the_rest_round_robin_at_their_offsets() -> None:
    wl = BT.workload(BT.Plan(workload="multi-turn", requests=60))
    rows = T.jitter(wl.rows, 2, wl.jitter_ms)
    records = T.aiperf_records(rows, T.TraceScale(), 10.0)
    chosen = OB.indices(len(records), 0.3, seed=0)
    inband, oob = OB.split(records, chosen, workers=4)
    assert len(inband) + len(oob) == 60 and len(oob) == 18
    assert inband[0] == records[0] and inband[0]["timestamp"] == 0  # AIPerf's auto-offset keeps the clock
    assert inband == [r for i, r in enumerate(records) if i not in chosen]  # same records, same timestamps
    assert [r.index for r in oob] == sorted(chosen)
    assert all((r.offset_ms, r.text, r.output_tokens) == (records[r.index]["timestamp"], records[r.index][
        "text_input"], records[r.index]["output_length"]) for r in oob)
    assert [r.worker for r in oob] == [k % 4 for k in range(18)]
    # the jitter seed moves the arrivals, not which requests go out of band
    other = T.aiperf_records(T.jitter(wl.rows, 1, wl.jitter_ms), T.TraceScale(), 10.0)
    assert [r.index for r in OB.split(other, chosen, 4)[1]] == [r.index for r in oob]


def test_out_of_band_names_parse_and_only_fit_in_front_of_a_plain_configuration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert OB.parse("c-oob10") == ("c", 0.1) and OB.parse("e-oob30") == ("e", 0.3)
    assert OB.parse("c") is None and OB.parse("g2e") is None and OB.parse("c-oob0") is None
    assert OB.base_config("e-oob30") == "e" and OB.base_config("g2") == "g2"
    assert all(k in BT.OPT_IN for k in ("g2", "g2e", "c-oob10", "e-oob10", "c-oob30", "e-oob30"))
    monkeypatch.setattr(BT, "CONFIGS", dict(BT.CONFIGS))
    BT.register_oob(["c", "b-oob20", "g2-oob10"])
    assert "b-oob20" in BT.CONFIGS and "g2-oob10" in BT.CONFIGS
    for bad in ("rs-oob10", "cv-oob30", "zz-oob10"):
        with pytest.raises(SystemExit):
            BT.register_oob([bad])


def _item3_doc(ttft: dict[str, float]) -> dict[str, Any]:
    """One load, one run spread of +-5% around each configuration's TTFT p90 (and its all-requests TTFT p90)."""
    def cell(cfg: str, t: float) -> dict[str, Any]:
        runs = [{"ttft_p90_ms": t * f, "all_ttft_p90_ms": t * f * 1.1, "output_tokens_per_s": 1000.0 * f,
                 "aiperf_cached_ratio": 0.5} for f in (0.95, 1.0, 1.05)]
        return {"capacity": "75", "config": cfg, "offered_rps": 36.0, "divisor": 1.0, "runs": runs,
                "summary": {"ttft_p90_ms": {"median": t}, "aiperf_cached_ratio": {"median": 0.5}}}
    return _one_load_doc([cell(k, v) for k, v in ttft.items()], 36.0)


def _one_load_doc(cells: list[dict[str, Any]], rps: float) -> dict[str, Any]:
    """A bench_trace document of these cells at one load of the 75 capacity, with its claims."""
    doc: dict[str, Any] = {"result": {"cells": cells, "capacities": [
        {"name": "75", "oracle": {"pooled_lru": 0.6},
         "clairvoyant": [{"offered_rps": rps, "cached_ratio": {"median": 0.65}}]}]}}
    doc["claims"] = claims(doc)
    return doc


def test_claims_compare_the_two_gateways_and_each_out_of_band_share_with_prediction_only_under_the_same() -> None:
    doc = _item3_doc({"c": 200.0, "e": 300.0, "g2": 250.0, "g2e": 500.0, "c-oob10": 220.0, "e-oob10": 400.0,
                      "c-oob30": 300.0, "e-oob30": 310.0})
    pairs = {(k["config"], k["baseline"]) for k in doc["claims"]}
    assert {("g2", "g2e"), ("g2", "c"), ("g2e", "e"), ("c-oob10", "e-oob10"), ("c-oob30", "e-oob30"),
            ("c-oob10", "c"), ("c-oob30", "c")} <= pairs
    assert not any(k["config"] == "e-oob10" for k in doc["claims"])  # prediction-only is the yardstick
    oob = {k["metric"]: k for k in doc["claims"] if (k["config"], k["baseline"]) == ("c-oob10", "e-oob10")}
    assert oob["ttft_p90_ms"]["claim"] == pytest.approx(400 / 220)
    assert oob["all_ttft_p90_ms"]["claim"] == pytest.approx(400 / 220)  # every request, oriented as a latency
    assert "all_ttft_p90_ms" not in {k["metric"] for k in doc["claims"] if k["baseline"] == "c"}
    t = targets(doc)["75"]
    assert set(k for k in t if "_beats_" in k) == {"g2_beats_g2e", "c-oob10_beats_e-oob10", "c-oob30_beats_e-oob30"}
    assert t["g2_beats_g2e"]["met"] is True and t["c-oob10_beats_e-oob10"]["met"] is True
    assert t["c-oob30_beats_e-oob30"]["met"] is False  # 300 vs 310: the spreads overlap, no claim
    assert t["c-oob30_beats_e-oob30"]["lost_somewhere"] is False


def test_a_claimed_loss_misses_the_item3_target_even_beside_a_win() -> None:
    t = targets(_item3_doc({"g2": 500.0, "g2e": 250.0}))["75"]["g2_beats_g2e"]
    assert t["won_somewhere"] is False and t["lost_somewhere"] is True and t["met"] is False


def test_aiperf_s_per_record_export_gives_the_first_credit_and_the_profiling_ttfts(tmp_path: Path) -> None:
    def rec(phase: str, credit: int, ttft: float | None) -> str:
        m = {"time_to_first_token": {"value": ttft, "unit": "ms"}} if ttft is not None else {}
        return json.dumps({"metadata": {"benchmark_phase": phase, "credit_issued_ns": credit}, "metrics": m})
    (tmp_path / "profile_export.jsonl").write_text("\n".join([
        rec("warmup", 5, 1.0), rec("profiling", 20, 10.0), rec("profiling", 10, 30.0), rec("profiling", 30, None)]))
    assert OB.aiperf_records(tmp_path) == ([10.0, 30.0], 10)
    assert OB.aiperf_records(tmp_path / "missing") == ([], None)


def test_aiperf_s_per_record_export_gives_each_scheduled_request_s_usage_and_none_for_a_failed_one(
        tmp_path: Path) -> None:
    def rec(n: int, credit: int, usage: tuple[int, int] | None, phase: str = "profiling") -> str:
        m = ({"usage_prompt_tokens": {"value": usage[0]}, "usage_prompt_cache_read_tokens": {"value": usage[1]}}
             if usage else {})
        r: dict[str, Any] = {"metadata": {"benchmark_phase": phase, "credit_issued_ns": credit,
                                          "conversation_id": f"session_{n:06d}"}, "metrics": m}
        if usage is None:
            r["error"] = {"code": 500}
        return json.dumps(r)
    (tmp_path / "profile_export.jsonl").write_text("\n".join([
        rec(2, 30, (100, 60)), rec(0, 10, (50, 0)), rec(1, 20, None), rec(9, 1, (1, 1), phase="warmup")]))
    assert BT.aiperf_usage(tmp_path) == ({0: (50, 0), 1: None, 2: (100, 60)}, 10)


def _window_doc(window: dict[str, list[float]]) -> dict[str, Any]:
    """One load, each configuration's window cached ratio per run (three runs)."""
    def cell(cfg: str, xs: list[float]) -> dict[str, Any]:
        runs = [{"window_cached_ratio": x, "window_requests": 270, "window_failed": 0, "window_s": 6.0,
                 "errors": 0, "aiperf_cached_ratio": 0.5, "window": {"matched": {}}} for x in xs]
        return {"capacity": "75", "config": cfg, "offered_rps": 17.5, "divisor": 1.0, "runs": runs,
                "summary": BT.S.summarize(runs, [*BT.WINDOW_METRICS, "aiperf_cached_ratio"])}
    return _one_load_doc([cell(k, v) for k, v in window.items()], 17.5)


def test_the_relay_restart_is_within_5pct_of_c_by_the_ratio_of_window_medians_without_a_claim() -> None:
    t = targets(_window_doc({"c": [0.70, 0.72, 0.74], "e": [0.60, 0.62, 0.64], "rsn": [0.69, 0.70, 0.73]}))["75"]
    near = t["rsn_window_within_5pct_of_c"]
    assert near["per_load"][0]["ratio"] == pytest.approx(0.70 / 0.72) and near["met"] is True


def test_the_relay_restart_beats_prediction_only_in_the_window_only_by_a_claim() -> None:
    t = targets(_window_doc({"c": [0.70, 0.72, 0.74], "e": [0.60, 0.62, 0.70], "rsn": [0.69, 0.70, 0.73]}))["75"]
    beats = t["rsn_beats_e_in_window"]["per_load"][0]
    assert beats["median_ratio"] == pytest.approx(0.70 / 0.62) and beats["claim"] is None and beats["met"] is False


def test_matched_windows_give_the_unrestarted_run_s_ratio_over_the_requests_the_restarted_run_served() -> None:
    c = {"config": "c", "window": {}, "_window_usage": {0: (100, 90), 1: (100, 10), 2: (100, 50)}}
    rsn = {"config": "rsn", "window": {}, "_window_usage": {0: (100, 80), 1: None, 2: (100, 40)}}
    BT.matched_windows([c, rsn])
    assert c["window"]["matched"] == {"rsn": pytest.approx(0.7)}
    assert "_window_usage" not in c and "_window_usage" not in rsn


def test_envoy_writes_the_timing_log_only_when_a_benchmark_asks_for_it() -> None:
    from epp_extproc.dev import envoy_config as E

    def loggers(opts: E.EnvoyOptions) -> list[str]:
        hcm = E.to_dict(opts)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        return [a["name"] for a in hcm.get("access_log", [])]

    assert "envoy.access_loggers.file" not in loggers(E.EnvoyOptions())
    assert "envoy.access_loggers.file" in loggers(E.EnvoyOptions(timing_log_path="/tmp/t.log"))


def test_the_timing_log_parses_durations_as_microseconds_and_dashes_as_missing() -> None:
    from epp_extproc.dev import envoy_config as E

    line = "\t".join(["fixed-schedule-session_000007", "1796490552.670058", "127.0.0.1:27958", "87", "5121",
                      "1316", "-", "6400", "-"])
    (row,) = E.parse_timing_log(line + "\nnot a timing line\n")
    assert row["correlation_id"] == "fixed-schedule-session_000007" and row["upstream_host"] == "127.0.0.1:27958"
    assert row["to_upstream_us"] == 5121 and row["upstream_first_body_us"] is None


def _req(worker: str, cached: int, ttft: float, up_us: int, first_body_us: int) -> dict[str, Any]:
    return {"ttft_ms": ttft, "cached_tokens": cached, "worker": worker, "to_upstream_us": up_us,
            "upstream_first_body_us": first_body_us}


def test_request_deltas_compare_only_equal_placements_and_split_the_ttft_into_its_legs() -> None:
    c = {0: _req("w0", 64, 10.0, 4000, 5000), 1: _req("w1", 0, 20.0, 4000, 15000), 2: _req("w2", 32, 12.0, 4000, 7000)}
    x = {0: _req("w0", 64, 12.0, 4500, 5500), 1: _req("w3", 0, 90.0, 9000, 80000),  # another worker: routing
         2: _req("w2", 32, 14.0, 4500, 7500)}
    rows = [{"config": "c", "_requests": c}, {"config": "r3n", "_requests": x}]
    BT.request_deltas(rows)
    r = rows[1]
    assert r["vs_c"] == {"requests": 3, "same_worker": 2, "same_cached": 3, "less_cached": 0, "compared": 2}
    assert r["vs_c_dttft_ms"] == 2.0 and r["vs_c_dto_upstream_ms"] == 0.5
    assert r["vs_c_dworker_first_body_ms"] == 0.5 and r["vs_c_rest_ms"] == 1.0
    assert "_requests" not in rows[0] and "_requests" not in rows[1] and "vs_c" not in rows[0]


def _tier_doc(t_ttft: float, t_cached: float, with_a: bool = True) -> dict[str, Any]:
    """(a), (c) GPU-only credit and (t) tiered credit at two loads, with a host tier whose bound is 0.65."""
    def cell(cfg: str, rate: float, ttft: float, cached: float) -> dict[str, Any]:
        runs = _runs([ttft * 0.95, ttft, ttft * 1.05], [cached - 0.005, cached, cached + 0.005])
        return {"capacity": "scarce", "config": cfg, "offered_rps": rate, "divisor": 1.0, "runs": runs,
                "summary": {"ttft_p90_ms": {"median": ttft}, "aiperf_cached_ratio": {"median": cached}}}
    cells = [cell("c", 17.5, 250.0, 0.52), cell("t", 17.5, 200.0, 0.62),
             cell("c", 25.0, 800.0, 0.45), cell("t", 25.0, t_ttft, t_cached)]
    if with_a:
        cells += [cell("a", 17.5, 1000.0, 0.35), cell("a", 25.0, 3100.0, 0.36)]
    doc: dict[str, Any] = {
        "configs": {"a": "envoy round-robin", "c": "picker, KV-aware (defaults)",
                    "t": "picker, KV-aware, --tiered-credit"},
        "result": {"cells": cells, "capacities": [
            {"name": "scarce", "oracle": {"pooled_lru": 0.58},
             "oracle_gpu_and_host": {"pooled_lru": 0.65, "infinite": 0.65},
             "clairvoyant": [{"offered_rps": r, "cached_ratio": {"median": 0.64}} for r in (17.5, 25.0)]}]}}
    doc["claims"] = claims(doc)
    return doc


def test_a_tiered_variant_is_judged_on_ttft_against_gpu_only_credit_at_saturation_by_a_claim() -> None:
    t = targets(_tier_doc(t_ttft=400.0, t_cached=0.60))["scarce"]
    k = t["t_ttft_p90_1.5x_below_c_at_saturation"]
    assert k["saturating_rps"] == 25.0 and k["claim"] == pytest.approx(2.0) and k["met"] is True
    t = targets(_tier_doc(t_ttft=600.0, t_cached=0.60))["scarce"]
    assert t["t_ttft_p90_1.5x_below_c_at_saturation"]["met"] is False  # 1.33x


def test_a_tiered_variant_s_cached_or_loaded_ratio_is_judged_against_the_two_tier_bound_at_every_load() -> None:
    t = targets(_tier_doc(t_ttft=400.0, t_cached=0.59))["scarce"]["t_cached_or_loaded_within_10pct_of_two_tier_bound"]
    assert [p["over_bound"] for p in t["per_load"]] == pytest.approx([0.62 / 0.65, 0.59 / 0.65])
    assert t["met"] is True
    t = targets(_tier_doc(t_ttft=400.0, t_cached=0.57))["scarce"]["t_cached_or_loaded_within_10pct_of_two_tier_bound"]
    assert t["met"] is False  # 0.877 of the bound at 25 req/s


def test_without_round_robin_the_tier_targets_are_judged_at_the_top_load() -> None:
    t = targets(_tier_doc(t_ttft=400.0, t_cached=0.60, with_a=False))["scarce"]
    assert t["t_ttft_p90_1.5x_below_c_at_saturation"]["saturating_rps"] == 25.0


def test_a_run_without_a_host_tier_has_no_tier_targets() -> None:
    doc = _tier_doc(t_ttft=400.0, t_cached=0.60)
    del doc["result"]["capacities"][0]["oracle_gpu_and_host"]
    assert not [k for k in targets(doc)["scarce"] if k.startswith("t_")]


def test_a_workload_with_nothing_to_reuse_has_no_cached_or_loaded_verdict() -> None:
    doc = _tier_doc(t_ttft=400.0, t_cached=0.0)
    doc["result"]["capacities"][0]["oracle_gpu_and_host"] = {"pooled_lru": 0.0, "infinite": 0.0}
    t = targets(doc)["scarce"]["t_cached_or_loaded_within_10pct_of_two_tier_bound"]
    assert t["met"] is None and t["per_load"][0]["over_bound"] is None
